"""Which pages may open the generation websocket: the playground's own origin, and the ones its operator trusts.

A browser sends cookies with a websocket handshake whatever page opens it, and no CORS check applies, so
the server must look at the Origin header itself. Channels' AllowedHostsOriginValidator compares only the
origin's host name with ALLOWED_HOSTS: a page served from another port of the same host (a dev server on
localhost:3000 beside the playground on localhost:8000, another service on the demo's host) passed. Here
the origin must name the host *and port* the socket was opened to (its Host header), as Django's CSRF
check asks of a form, or be listed in DJANGO_CSRF_TRUSTED_ORIGINS (a proxy that rewrites the Host header,
a second front-end name). The Host itself must be one of ALLOWED_HOSTS, as for every HTTP request.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from django.conf import settings
from django.http.request import is_same_domain, validate_host
from django.middleware.csrf import CsrfViewMiddleware

log = logging.getLogger(__name__)
DEFAULT_PORTS = {"http": 80, "https": 443}


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin1")
    return None


def _host_and_port(netloc: str, default_port: int | None) -> tuple[str, int | None] | None:
    """("example.com", 443) from "example.com:443", or from "example.com" when 443 is the default; None if
    the text is no host name (an empty one, a port that is not a number)."""
    try:
        parts = urlsplit("//" + netloc)
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return parts.hostname.lower(), port if port is not None else default_port


def _trusted(origin: str) -> bool:
    """Whether DJANGO_CSRF_TRUSTED_ORIGINS lists the origin, matched as Django's CSRF check matches a form's
    (exactly, or https://*.example.com for its subdomains); a new instance reads the current settings."""
    csrf = CsrfViewMiddleware(lambda request: None)
    if origin in csrf.allowed_origins_exact:
        return True
    parsed = urlsplit(origin)
    return any(
        is_same_domain(parsed.netloc, host) for host in csrf.allowed_origin_subdomains.get(parsed.scheme, ())
    )


def origin_allowed(origin: str | None, host_header: str | None) -> bool:
    """True when a page of `origin` may open a socket that arrived with Host `host_header`."""
    if not origin or not host_header:
        return False
    parsed = urlsplit(origin.strip().lower())
    if parsed.scheme not in ("http", "https") or parsed.path or parsed.query:
        return False  # "null" (a sandboxed frame, a file: page) and anything that is not an origin
    origin_at = _host_and_port(parsed.netloc, DEFAULT_PORTS[parsed.scheme])
    # The socket's own Host without a port means the default port of the scheme the page used: behind a
    # TLS proxy daphne sees ws://, while the page (and its Origin) is https:// on 443.
    host_at = _host_and_port(host_header.strip(), DEFAULT_PORTS[parsed.scheme])
    if origin_at is None or host_at is None:
        return False
    allowed_hosts = settings.ALLOWED_HOSTS or (["localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    if not validate_host(host_at[0] if ":" not in host_at[0] else f"[{host_at[0]}]", allowed_hosts):
        return False
    return origin_at == host_at or _trusted(origin.strip())


async def _refuse(receive, send) -> None:
    """Close before accepting: the server answers the handshake with HTTP 403. No consumer is built for it
    (channels' WebsocketDenier is one, and takes a channel-layer channel, a Redis round trip, per refusal)."""
    message = await receive()
    if message["type"] == "websocket.connect":
        await send({"type": "websocket.close", "code": 1008})  # policy violation, had it been open


class SameOriginValidator:
    """ASGI middleware for the websocket router: a handshake from any other origin is refused (HTTP 403
    before the upgrade), and the refusal is logged with both names."""

    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            raise ValueError("SameOriginValidator guards websocket connections only")
        origin, host = _header(scope, b"origin"), _header(scope, b"host")
        if origin_allowed(origin, host):
            return await self.application(scope, receive, send)
        log.warning("websocket refused: origin %r is not the page's own (Host %r) nor trusted", origin, host)
        await _refuse(receive, send)
