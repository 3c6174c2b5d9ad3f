"""Cross-origin calls to /v1/ from web apps the operator names (PLAYGROUND_API_CORS_ORIGINS).

    PLAYGROUND_API_CORS_ORIGINS   comma-separated origins (https://ide.example.com), or * for any; unset: none

Off by default: a browser then refuses a page of another origin the API's answers, as the same-origin rule
says. The API authenticates by bearer key, not by cookie, so allowing an origin hands it nothing a script there
did not already hold; credentials (cookies) are never allowed across origins. A preflight (OPTIONS with
Access-Control-Request-Method) is answered here, before the views, which take only their own methods.
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponse
from django.utils.deprecation import MiddlewareMixin

from playground.host_check import API_PREFIX

ALLOWED_METHODS = "GET, HEAD, POST"
ALLOWED_HEADERS = "Authorization, Content-Type, OpenAI-Organization, OpenAI-Project, X-Stainless-Lang"
PREFLIGHT_MAX_AGE_S = 600


def allowed_origin(origin: str | None) -> str | None:
    """The value of Access-Control-Allow-Origin for this request's Origin, or None to send no CORS header."""
    origins = settings.PLAYGROUND_API_CORS_ORIGINS
    if not origin or not origins:
        return None
    if "*" in origins:
        return "*"
    return origin if origin in origins else None


class ApiCorsMiddleware(MiddlewareMixin):  # the mixin keeps the async chain async under daphne
    def process_request(self, request):
        if not request.path.startswith(API_PREFIX) or request.method != "OPTIONS":
            return None
        if "HTTP_ACCESS_CONTROL_REQUEST_METHOD" not in request.META:
            return None  # a plain OPTIONS: the view's 405 with Allow
        origin = allowed_origin(request.headers.get("Origin"))
        if origin is None:
            return None  # no CORS headers on the view's 405: the browser refuses the call
        response = HttpResponse(status=204)
        response["Access-Control-Allow-Methods"] = ALLOWED_METHODS
        # what the official JS client sends, and whatever else this preflight asks for
        asked = request.headers.get("Access-Control-Request-Headers", "")
        response["Access-Control-Allow-Headers"] = ", ".join(filter(None, [ALLOWED_HEADERS, asked]))
        response["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE_S)
        return response

    def process_response(self, request, response):
        if not request.path.startswith(API_PREFIX):
            return response
        origin = allowed_origin(request.headers.get("Origin"))
        if origin is not None:
            response["Access-Control-Allow-Origin"] = origin
            # a 429's or 503's wait and the request's id (the server's log names it), for the script to read
            response["Access-Control-Expose-Headers"] = "Retry-After, X-Request-Id"
            if origin != "*":
                response["Vary"] = ", ".join(filter(None, [response.get("Vary"), "Origin"]))
        return response
