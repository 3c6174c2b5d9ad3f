"""Security headers (playground/security.py) and production settings read from the environment."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
from urllib.parse import urlsplit

import httpx
import pytest
from django.http import HttpResponse
from django.test import RequestFactory

from playground.security import SecurityHeadersMiddleware
from tests.support import ROOT


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


def settings_in_a_fresh_process(env: dict, code: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
    full = {
        **base,
        "DJANGO_SETTINGS_MODULE": "playground.settings",
        "DATABASE_URL": "sqlite:///:memory:",
        **env,
    }
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True)


def test_serving_with_debug_off_needs_a_secret_key():
    refused = settings_in_a_fresh_process({}, "import playground.asgi")
    assert refused.returncode != 0
    assert "DJANGO_SECRET_KEY must be set to serve with DJANGO_DEBUG off" in refused.stderr
    assert (
        settings_in_a_fresh_process({"DJANGO_SECRET_KEY": "k" * 50}, "import playground.asgi").returncode == 0
    )
    # a management command needs no stable key
    check = settings_in_a_fresh_process({}, "import django; django.setup(); print('ok')")
    assert check.returncode == 0 and check.stdout.strip() == "ok"


def test_behind_a_tls_proxy_cookies_are_secure_and_hsts_is_on():
    code = (
        "import django; django.setup(); from django.conf import settings as s; "
        "print(s.DEBUG, s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_HSTS_SECONDS, "
        "s.SECURE_SSL_REDIRECT, s.SECURE_PROXY_SSL_HEADER[0])"
    )
    out = settings_in_a_fresh_process({"DJANGO_BEHIND_HTTPS_PROXY": "1", "DJANGO_SECRET_KEY": "k" * 50}, code)
    assert out.stdout.split() == ["False", "True", "True", "31536000", "True", "HTTP_X_FORWARDED_PROTO"]
    out = settings_in_a_fresh_process(
        {"DJANGO_SECRET_KEY": "k" * 50}, code.replace(", s.SECURE_PROXY_SSL_HEADER[0]", "")
    )
    assert out.stdout.split() == [
        "False",
        "False",
        "False",
        "0",
        "False",
    ]  # plain HTTP: no secure-only cookie


def test_the_admin_is_behind_a_login(client):
    response = client.get("/admin/")
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")


def test_an_api_call_for_a_foreign_host_gets_json_from_the_official_client(start_web):
    """Django's refusal is an HTML page; an agent's client needs the OpenAI error shape to say why."""
    import openai

    web = start_web()
    client = openai.OpenAI(base_url=web.url + "/v1", api_key="unused", default_headers={"Host": "evil.example"},
                           max_retries=0)  # fmt: skip
    with pytest.raises(openai.BadRequestError) as refused:
        client.models.list()
    assert refused.value.code == "disallowed_host" and refused.value.param == "Host"
    assert "DJANGO_ALLOWED_HOSTS" in refused.value.message and "evil.example" not in refused.value.message
    # the right host still works on the same server
    assert (
        openai.OpenAI(base_url=web.url + "/v1", api_key="unused", max_retries=0).models.list().data
        is not None
    )


@pytest.mark.parametrize("debug", [False, True])
def test_only_api_paths_answer_a_foreign_host_in_json(client, settings, debug):
    settings.DEBUG = debug
    api = client.get("/v1/models", HTTP_HOST="evil.example")
    assert api.status_code == 400 and api["Content-Type"] == "application/json"
    assert api.json()["error"]["code"] == "disallowed_host"
    page = client.get("/", HTTP_HOST="evil.example")
    assert page.status_code == 400 and not page["Content-Type"].startswith("application/json")
    assert client.get("/v1/models", HTTP_HOST="localhost").status_code != 400


def vm_peak_mib(pid: int) -> float:
    """The most memory the process has held at once (Linux' VmHWM), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def post_until_answered(url: str, chunked: bool, total: int) -> tuple[int, bytes]:
    """POST a body of `total` bytes a MiB at a time, stopping as soon as the server answers or stops
    reading; returns (bytes sent, the answer)."""
    parts = urlsplit(url)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nConnection: close\r\n"
        "Content-Type: application/json\r\n"
    )
    piece, sent = b"0" * (1 << 20), 0
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"{head}{framing}\r\n\r\n".encode())
        try:
            while sent < total and not select.select([sock], [], [], 0)[0]:
                sock.sendall(b"100000\r\n" + piece + b"\r\n" if chunked else piece)
                sent += len(piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading: its answer is waiting
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    return sent, answer


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_oversized_body_is_refused_while_it_arrives_not_held_first(start_web, chunked):
    """daphne used to take in a whole body, then queue all of it in memory before Django refused it."""
    web = start_web()
    before = vm_peak_mib(web.process.pid)
    total = 256 << 20
    sent, answer = post_until_answered(web.url, chunked, total)
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"code": "body_too_large"' in answer
    assert sent < total // 4  # refused at the limit (2.5 MiB), give or take the sockets' buffers
    assert vm_peak_mib(web.process.pid) - before < 64
    # a body within the limit still reaches the API, and the server keeps serving
    small = httpx.post(web.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
    assert small.status_code == 404 and small.json()["error"]["code"] == "model_not_found"


def test_a_static_path_that_climbs_out_is_a_400_not_a_crash(start_web):
    web = start_web()
    climbing = httpx.get(web.url + "/static/%2e%2e/%2e%2e/settings.py", timeout=10)
    assert climbing.status_code == 400 and "settings" not in climbing.text
    assert httpx.get(web.url + "/static/playground/favicon.svg", timeout=10).status_code == 200
    assert "Exception inside application" not in web.log_path.read_text()
