"""An API request for a host this server does not answer to gets an OpenAI-shaped JSON error.

Django refuses such a request (DisallowedHost) with an HTML page: its debug page when DEBUG is on, a
bare "Bad Request" otherwise. An agent calling /v1/ with the official client then sees an HTML body
it cannot parse and no hint of the cause. This middleware, first in the chain, answers those requests
itself; the page and the rest keep Django's behaviour.
"""

from __future__ import annotations

import logging

from django.core.exceptions import DisallowedHost
from django.utils.deprecation import MiddlewareMixin

from playground.api.errors import ApiError

log = logging.getLogger(__name__)
API_PREFIX = "/v1/"


class ApiHostCheckMiddleware(MiddlewareMixin):  # the mixin keeps the async chain async under daphne
    def process_request(self, request):
        if not request.path.startswith(API_PREFIX):
            return None
        try:
            request.get_host()
        except DisallowedHost:
            # the refused name is the client's own input: logged, not echoed into the body
            log.warning("api request for a host not in ALLOWED_HOSTS: %r", request.META.get("HTTP_HOST"))
            return ApiError(
                400,
                "Host header: this server does not answer to that host name (its operator lists the names it "
                "serves in DJANGO_ALLOWED_HOSTS)",
                code="disallowed_host",
                param="Host",
            ).response()
        return None
