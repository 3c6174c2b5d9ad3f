"""Response headers Django 5.2 does not set itself: a Content-Security-Policy, and a Permissions-Policy.

The policy allows scripts, styles, fonts and images from this origin only (no inline script, no
eval, no inline style element), websockets to this host, and no framing. The page is built for
it: scripts are files, htmx runs with allowEval off and its indicator style off. With DEBUG on,
the policy is only reported (Content-Security-Policy-Report-Only), because Django's debug pages
are made of inline styles and scripts.

    PLAYGROUND_CSP   a policy of your own, replacing the one below ("{host}" stands for the request's host)
"""

from __future__ import annotations

import os

from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.utils.deprecation import MiddlewareMixin

DEFAULT_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "font-src 'self'",
        # 'self' covers ws: and wss: in CSP 3; older browsers need the host spelled out
        "connect-src 'self' ws://{host} wss://{host}",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
PERMISSIONS_POLICY = "camera=(), microphone=(), geolocation=(), payment=(), usb=()"
# Static files skip the middleware chain (asgi.py serves them before it): Django's SecurityMiddleware gives
# them nosniff and the referrer policy there, and these. Their policy is tighter than a page's: a file opened
# as a document (favicon.svg in a tab) may load only images, styles and fonts of this origin and runs
# sandboxed (no script, no forms, no same-origin access); scripts and stylesheets fetched by the page are not
# documents, and no CSP applies to them.
STATIC_FILE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; img-src 'self' data:; style-src 'self'; font-src 'self'; "
    "frame-ancestors 'none'; sandbox",
    "Cross-Origin-Resource-Policy": "same-origin",  # other sites do not embed the playground's files
}


def content_security_policy(host: str | None) -> str:
    policy = os.environ.get("PLAYGROUND_CSP", DEFAULT_POLICY)
    if host is None:  # a request for a host we do not serve: allow no websocket at all
        policy = policy.replace(" ws://{host} wss://{host}", "")
    return policy.replace("{host}", host or "invalid.invalid")


class SecurityHeadersMiddleware(MiddlewareMixin):
    def process_response(self, request, response):
        try:
            host = request.get_host()
        except DisallowedHost:  # the response is already an error page
            host = None
        header = "Content-Security-Policy-Report-Only" if settings.DEBUG else "Content-Security-Policy"
        response.headers.setdefault(header, content_security_policy(host))
        response.headers.setdefault("Permissions-Policy", PERMISSIONS_POLICY)
        return response
