"""Which pages may open the generation websocket (playground/ws_origin.py)."""

from __future__ import annotations

import logging

import pytest
from channels.testing import WebsocketCommunicator

from playground.asgi import application  # first: it configures logging, which caplog then hooks into
from playground.ws_origin import origin_allowed


@pytest.fixture
def hosts(settings):
    settings.DEBUG = False
    settings.ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]", "play.example.com", ".example.org"]
    settings.CSRF_TRUSTED_ORIGINS = []
    return settings


@pytest.mark.parametrize(
    ("origin", "host"),
    [
        ("http://localhost:8000", "localhost:8000"),
        ("http://LOCALHOST:8000", "localhost:8000"),  # host names are case-blind
        ("http://127.0.0.1", "127.0.0.1"),
        ("http://127.0.0.1:80", "127.0.0.1"),  # the default port, spelled out or not
        ("http://[::1]:8000", "[::1]:8000"),
        # behind a TLS proxy that keeps Host: daphne sees ws://, the page is https:// on 443
        ("https://play.example.com", "play.example.com"),
        ("https://play.example.com:443", "play.example.com"),
        ("https://a.example.org", "a.example.org"),  # ALLOWED_HOSTS' subdomain pattern
    ],
)
def test_a_page_of_the_sockets_own_host_and_port_may_open_it(hosts, origin, host):
    assert origin_allowed(origin, host)


@pytest.mark.parametrize(
    ("origin", "host"),
    [
        ("http://localhost:3000", "localhost:8000"),  # another port of the same host: the bug this guards
        ("http://localhost", "localhost:8000"),
        ("http://localhost:8000", "localhost"),
        ("https://play.example.com:8443", "play.example.com"),
        ("http://evil.example", "localhost:8000"),
        ("http://localhost.evil.example:8000", "localhost:8000"),
        ("http://evil.example:8000", "evil.example:8000"),  # a Host this server does not answer to
        ("null", "localhost:8000"),  # a sandboxed frame, a file: page
        ("file://", "localhost:8000"),
        ("http://localhost:8000/path", "localhost:8000"),
        ("http://localhost:http", "localhost:8000"),
        ("", "localhost:8000"),
        (None, "localhost:8000"),
        ("http://localhost:8000", None),
        ("http://localhost:8000", ""),
        ("http://localhost:8000", "localhost:x"),
    ],
)
def test_any_other_page_may_not(hosts, origin, host):
    assert not origin_allowed(origin, host)


def test_the_operators_trusted_origins_pass_whatever_the_host_header_says(hosts):
    # a proxy in front rewrites Host to the container's name, which the operator lists as served
    hosts.ALLOWED_HOSTS = ["web"]
    assert not origin_allowed("https://play.example.com", "web:8000")
    hosts.CSRF_TRUSTED_ORIGINS = ["https://play.example.com", "https://*.example.net"]
    assert origin_allowed("https://play.example.com", "web:8000")
    assert origin_allowed("https://b.example.net", "web:8000")
    assert not origin_allowed("http://play.example.com", "web:8000")  # another scheme
    assert not origin_allowed("https://play.example.com:8443", "web:8000")  # another port
    assert not origin_allowed("https://example.com", "web:8000")
    assert not origin_allowed("https://play.example.com", "evil:8000")  # still only hosts it serves


@pytest.mark.django_db
async def test_a_handshake_from_another_port_is_refused_and_logged(hosts, caplog):
    headers = [(b"origin", b"http://localhost:3000"), (b"host", b"localhost:8000")]
    communicator = WebsocketCommunicator(application, "/ws/generate/", headers=headers)
    with caplog.at_level(logging.WARNING, logger="playground.ws_origin"):
        connected, _ = await communicator.connect()
    assert not connected
    assert "'http://localhost:3000'" in caplog.text and "'localhost:8000'" in caplog.text

    # the same handshake from the socket's own port is let through to the consumer
    headers = [(b"origin", b"http://localhost:8000"), (b"host", b"localhost:8000")]
    communicator = WebsocketCommunicator(application, "/ws/generate/", headers=headers)
    connected, _ = await communicator.connect()
    assert connected
    await communicator.disconnect()
