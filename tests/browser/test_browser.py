"""What a person sees: Debian's chromium, driven by playwright, on the page that daphne serves.

The stand-in engine echoes the prompt, so the expected output is known exactly.
"""

from __future__ import annotations

import re

import pytest

from tests.support.page import (
    LEFT_EDGES,
    STANDIN,
    TROJAN,
    generate,
    open_playground,
    record_states,
    standin_server,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

MODEL = STANDIN
XSS = '<img src=x onerror=alert(1)>\n<script>alert("pwned")</script>\n<b onmouseover=alert(2)>bold</b>\n'


@pytest.fixture(scope="module")
def server(redis_server, tmp_path_factory):
    yield from standin_server(redis_server, tmp_path_factory.mktemp("browser"))


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.dialogs = []
    page.errors = []
    page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    yield page
    context.close()


def test_prompt_streams_with_live_speed_and_stop_keeps_partial_text(server, page):
    open_playground(page, server.url)
    prompt = "def greet(name):\n    return f'hello {name}'\n\n"
    generate(page, prompt, 3000)

    page.wait_for_function("() => document.getElementById('tokens').textContent > 20", timeout=15_000)
    assert page.get_attribute("#state", "data-state") == "streaming"
    assert float(page.text_content("#tok-s")) > 0
    assert float(page.text_content("#ttft")) >= 0
    assert (prompt * 100).startswith(page.text_content("#output"))
    assert page.is_disabled("#generate")

    page.click("#stop")
    page.wait_for_selector("#state[data-state=stopped]", timeout=10_000)
    shown = page.text_content("#output")
    tokens = int(page.text_content("#tokens"))
    assert 20 < tokens < 3000 and len(shown) == tokens  # one character per stand-in token
    assert shown == (prompt * 100)[:tokens]
    assert page.get_attribute("#output", "data-stream-check") == "ok"
    assert page.is_visible("#final-stats") and "tok/s" in page.text_content("#stat-decode")
    assert page.is_enabled("#generate") and page.is_visible("#copy")

    share = page.get_attribute("#share", "href")
    assert re.fullmatch(r"/g/[\w-]+", share)
    page.goto(server.url + share)
    assert page.text_content("#output") == shown
    assert page.errors == []


def test_model_output_is_shown_as_text_never_run_as_html(server, page):
    open_playground(page, server.url)
    generate(page, XSS, len(XSS))
    page.wait_for_selector("#state[data-state=done]", timeout=15_000)

    assert page.text_content("#output") == XSS
    for selector in ("#output img", "#output script", "#output b", "img[src=x]"):
        assert page.locator(selector).count() == 0, selector
    assert page.locator("#output span").count() > 0  # highlighted, with spans of our own making

    page.goto(server.url + page.get_attribute("#share", "href"))
    assert page.text_content("#output") == XSS
    assert page.locator("main img, main script").count() == 0
    page.wait_for_timeout(300)  # give an injected onerror handler the chance to fire
    assert page.dialogs == [] and page.errors == []


def assert_shown_in_order_with_the_control_marked(page, selector: str) -> None:
    edges = page.evaluate(LEFT_EDGES, [selector, "PQR"])
    assert edges == sorted(edges) and len(set(edges)) == 3, edges  # P, Q, R from left to right
    marker = page.locator(f"{selector} .bidi-control")
    assert marker.count() == 1 and marker.text_content() == "\u202e"
    shown = marker.evaluate("(el) => getComputedStyle(el, '::before').content")
    assert "U+202E" in shown


def test_text_direction_controls_are_shown_and_not_obeyed(server, page):
    open_playground(page, server.url)
    generate(page, TROJAN, len(TROJAN))
    page.wait_for_selector("#state[data-state=done]", timeout=15_000)
    assert page.text_content("#output") == TROJAN  # copied as it is: only its display changes
    assert_shown_in_order_with_the_control_marked(page, "#output")

    page.goto(server.url + page.get_attribute("#share", "href"))
    assert page.text_content("#output") == TROJAN and page.text_content("#share-prompt") == TROJAN
    assert_shown_in_order_with_the_control_marked(page, "#output")
    assert_shown_in_order_with_the_control_marked(page, "#share-prompt")
    assert page.errors == []


def test_dropped_connection_reconnects_and_resumes_without_gap_or_duplicate(server, page):
    sockets = []

    def through(ws):  # a pass-through proxy for the page's websocket, so the test can cut it
        ws.connect_to_server()
        sockets.append(ws)

    page.route_web_socket(re.compile(r".*/ws/generate/$"), through)
    open_playground(page, server.url)
    prompt = "".join(f"line {i:04d}\n" for i in range(120))  # 1,200 characters, all different
    generate(page, prompt, len(prompt))
    page.wait_for_function("() => document.getElementById('tokens').textContent > 100", timeout=15_000)
    record_states(page)
    sockets[0].close(code=1012, reason="service restart")  # what a restarting server sends

    page.wait_for_selector("#state[data-state=done]", timeout=20_000)
    assert len(sockets) == 2  # it reconnected once
    assert page.evaluate("window.seenStates")[:2] == ["reconnecting", "streaming"]
    assert page.text_content("#output") == prompt
    assert page.get_attribute("#output", "data-stream-check") == "ok"
    assert int(page.text_content("#tokens")) == len(prompt)
    assert page.errors == []
