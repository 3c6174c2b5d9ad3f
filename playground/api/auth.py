"""Bearer keys for /v1/: none needed until the first key is made, then a valid one on every call."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from playground.api.errors import ApiError
from playground.api.models import ApiKey, hash_key

LAST_USED_RESOLUTION = timedelta(minutes=1)  # write last_used at most once a minute per key


async def authenticate(request) -> ApiKey | None:
    """The request's key, None when the API is open; raises ApiError(401) for a missing or wrong key."""
    if not await ApiKey.objects.aexists():
        return None
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise ApiError(401, "Missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
    api_key = await ApiKey.objects.filter(key_hash=hash_key(key), revoked__isnull=True).afirst()
    if api_key is None:
        raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")
    now = timezone.now()
    if api_key.last_used is None or now - api_key.last_used > LAST_USED_RESOLUTION:
        await ApiKey.objects.filter(pk=api_key.pk).aupdate(last_used=now)
    return api_key
