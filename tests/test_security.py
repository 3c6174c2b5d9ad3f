"""Security headers (playground/security.py) and production settings read from the environment."""

from __future__ import annotations

from django.http import HttpResponse
from django.test import RequestFactory

from playground.security import SecurityHeadersMiddleware


def headers_for(request, settings, debug: bool = False) -> dict:
    settings.DEBUG = debug
    middleware = SecurityHeadersMiddleware(lambda request: HttpResponse("<p>page</p>"))
    return dict(middleware(request).headers)


def directives(policy: str) -> dict[str, list[str]]:
    return {d.split()[0]: d.split()[1:] for d in policy.split("; ")}


def test_the_policy_allows_this_origin_only_and_no_inline_code(settings):
    headers = headers_for(RequestFactory().get("/", HTTP_HOST="127.0.0.1:8000"), settings)
    policy = directives(headers["Content-Security-Policy"])
    assert policy["script-src"] == ["'self'"] and policy["style-src"] == ["'self'"]
    assert policy["connect-src"] == ["'self'", "ws://127.0.0.1:8000", "wss://127.0.0.1:8000"]
    assert policy["frame-ancestors"] == ["'none'"] and policy["object-src"] == ["'none'"]
    assert not any("unsafe" in source for sources in policy.values() for source in sources)
    assert "camera=()" in headers["Permissions-Policy"]


def test_with_debug_on_the_policy_is_only_reported(settings):
    headers = headers_for(RequestFactory().get("/", HTTP_HOST="localhost"), settings, debug=True)
    assert "Content-Security-Policy" not in headers
    assert "script-src 'self'" in headers["Content-Security-Policy-Report-Only"]


def test_a_request_for_a_host_we_do_not_serve_allows_no_websocket(settings):
    headers = headers_for(RequestFactory().get("/", HTTP_HOST="evil.example"), settings)
    assert directives(headers["Content-Security-Policy"])["connect-src"] == ["'self'"]


def test_an_operator_policy_replaces_ours(settings, monkeypatch):
    monkeypatch.setenv("PLAYGROUND_CSP", "default-src 'self'; connect-src wss://{host}")
    headers = headers_for(RequestFactory().get("/", HTTP_HOST="localhost"), settings)
    assert headers["Content-Security-Policy"] == "default-src 'self'; connect-src wss://localhost"
