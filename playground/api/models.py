"""API keys, stored as SHA-256 hashes: the key itself is shown once, when it is made.

Once any key exists (revoked ones included, so that revoking the last key never opens the API),
every /v1/ request needs `Authorization: Bearer <key>` with a key that is not revoked.
"""

from __future__ import annotations

import hashlib
import secrets

from django.db import models
from django.utils import timezone

KEY_PREFIX = "kog-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKey(models.Model):
    name = models.CharField(max_length=100, unique=True)
    prefix = models.CharField(max_length=16, help_text="The key's first characters, to tell keys apart.")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    created = models.DateTimeField(default=timezone.now)
    last_used = models.DateTimeField(null=True, blank=True)
    revoked = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def active(self) -> bool:
        return self.revoked is None

    def set_new_key(self) -> str:
        """Give this row a fresh secret; returns it (the only time it can be read)."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        self.prefix = key[:12]
        self.key_hash = hash_key(key)
        return key
