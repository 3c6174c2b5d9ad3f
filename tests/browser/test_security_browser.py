"""The public demo's defences as a browser meets them: Debian's chromium, driven by playwright.

The page runs under its Content-Security-Policy without a single violation; a page of another
origin cannot open the generation websocket, nor start a generation through the API with a form;
a client over its rate limit reads why on the page.
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys

import pytest
import redis

from common.protocol import PREFIX, job_key
from tests.support import ROOT, WebServer, WorkerProcess
from tests.support.page import LEFT_EDGES, TROJAN

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

MODEL = "standin:1000"
EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def worker(redis_server, tmp_path_factory):
    worker = WorkerProcess(redis_server, [MODEL], tmp_path_factory.mktemp("worker") / "worker.log")
    worker.wait_ready()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def server(redis_server, worker, tmp_path_factory):
    web = WebServer(redis_server, tmp_path_factory.mktemp("web"))
    yield web
    web.stop()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.console_lines = []
    page.errors = []
    page.on("console", lambda message: page.console_lines.append(f"{message.type}: {message.text}"))
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    # every violation, reported or enforced, lands here before any of the page's own scripts run
    page.add_init_script(
        """window.cspViolations = [];
        document.addEventListener("securitypolicyviolation",
            (e) => window.cspViolations.push(`${e.violatedDirective} ${e.blockedURI}`));"""
    )
    yield page
    context.close()


def run_generation(page, prompt: str) -> None:
    page.wait_for_selector(f'#model option[value="{MODEL}"]', state="attached")
    page.select_option("#model", MODEL)  # other tests' workers may still be listed for a few seconds
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", str(len(prompt)))
    page.click("#generate")


def test_the_page_runs_under_its_policy_without_a_violation(server, page):
    response = page.goto(server.url)
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    page.wait_for_selector("#worker-status[data-up=true]", timeout=15_000)
    run_generation(page, "def csp():\n    pass\n")
    page.wait_for_selector("#state[data-state=done]", timeout=15_000)  # websocket, highlighting, stats
    assert page.text_content("#output") == "def csp():\n    pass\n"
    page.goto(server.url + page.get_attribute("#share", "href"))  # the share page too
    page.goto(server.url + "/admin/login/")  # and the admin's login
    assert page.evaluate("window.cspViolations") == []
    assert not [line for line in page.console_lines if "Content Security Policy" in line]
    assert page.errors == []


def test_a_page_of_another_origin_cannot_open_the_websocket(server, page):
    ws_url = server.url.replace("http://", "ws://") + "/ws/generate/"
    opener = """(url) => new Promise((resolve) => {
        const ws = new WebSocket(url);
        ws.onopen = () => { resolve("open"); ws.close(); };
        ws.onclose = (e) => resolve(`closed ${e.code}`);
    })"""
    # The same browser, on a page of the site's own origin: the socket opens.
    page.goto(server.url + "/healthz")
    assert page.evaluate(opener, ws_url) == "open"
    # On a page served from another origin, the handshake is refused: another host, or the same host on
    # another port (which shares the site's cookies).
    other_port = f"http://127.0.0.1:{server.port + 1}"
    for origin in (EVIL, other_port):
        page.route(f"{origin}/**", lambda route: route.fulfill(content_type="text/html", body="<p>evil</p>"))
        page.goto(f"{origin}/")
        assert page.evaluate(opener, ws_url) == "closed 1006", origin


def jobs_with_prompt(redis_url: str, prompt: str) -> list[str]:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        specs = [r.hget(key, "spec") or "{}" for key in r.scan_iter(job_key("*"))]
    finally:
        r.close()
    return [spec for spec in specs if json.loads(spec).get("prompt") == prompt]


def test_a_form_on_a_page_of_another_origin_cannot_start_a_generation(server, page, redis_server):
    """A form posts across origins without the browser asking the server first (no CORS preflight).
    Sent as text/plain, `name=value` can spell a JSON body: the API must take JSON bodies only."""
    prompt = "started by another site"
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 3, "pad": ""})
    name, value = body[: -len('"}')], '"}'  # the form sends name + "=" + value: '..."pad": "="}'
    form = (
        f'<form method="post" enctype="text/plain" action="{server.url}/v1/completions">'
        f'<input type="hidden" name="{html.escape(name)}" value="{html.escape(value)}"></form>'
    )
    page.route(f"{EVIL}/**", lambda route: route.fulfill(content_type="text/html", body=form))
    page.goto(f"{EVIL}/")
    with page.expect_navigation() as navigation:
        page.evaluate("document.forms[0].submit()")
    response = navigation.value
    assert response.status == 415 and json.loads(response.text())["error"]["code"] == "unsupported_media_type"
    assert jobs_with_prompt(redis_server, prompt) == []


def test_a_client_over_its_rate_limit_reads_why_on_the_page(browser, redis_server, worker, tmp_path):
    r = redis.Redis.from_url(redis_server)
    for key in r.scan_iter(f"{PREFIX}rate:*"):  # this address's requests in the other tests
        r.delete(key)
    r.close()
    web = WebServer(redis_server, tmp_path, env={"PLAYGROUND_IP_REQUESTS_PER_MIN": "1"})
    page = browser.new_page()
    try:
        page.goto(web.url)
        page.wait_for_selector("#worker-status[data-up=true]", timeout=15_000)
        run_generation(page, "first\n")
        page.wait_for_selector("#state[data-state=done]", timeout=15_000)
        run_generation(page, "second\n")
        page.wait_for_selector("#state[data-state=error]", timeout=15_000)
        state = page.text_content("#state")
        assert "Rate limit reached: 1 requests per minute per IP address" in state
        assert "try again in" in state
        assert page.is_enabled("#generate")  # nothing is stuck "generating"
    finally:
        page.close()
        web.stop()


# ---- the admin shows a stranger's text as text ----------------------------------------------------------


def admin_login(server, page) -> None:
    env = {**server.env, "DJANGO_SUPERUSER_PASSWORD": "a-long-test-password"}
    subprocess.run([sys.executable, "manage.py", "createsuperuser", "--noinput", "--username", "admin",
                    "--email", "admin@example.com"], cwd=ROOT, env=env, capture_output=True)  # fmt: skip
    page.goto(server.url + "/admin/login/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "a-long-test-password")
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")


def test_the_admin_shows_a_generations_texts_in_monospace_boxes_with_direction_controls_named(server, page):
    prompt = TROJAN + "".join(f"x_{i:03d} = {i}\n" for i in range(60))  # a long output: 61 lines
    page.goto(server.url)
    page.wait_for_selector("#worker-status[data-up=true]", timeout=15_000)
    run_generation(page, prompt)
    page.wait_for_selector("#state[data-state=done]", timeout=15_000)
    generation_id = page.get_attribute("#share", "href").removeprefix("/g/")
    admin_login(server, page)

    page.goto(f"{server.url}/admin/playground/generation/{generation_id}/change/")
    for selector in (".field-prompt_text pre", ".field-output_text pre"):
        box = page.locator(selector)
        assert "monospace" in box.evaluate("el => getComputedStyle(el).fontFamily")
        # shown in the order it runs: P, Q, R left to right, and the control named, not obeyed
        edges = page.evaluate(LEFT_EDGES, [selector, "PQR"])
        assert edges == sorted(edges) and len(set(edges)) == 3, edges
        assert box.locator(".bidi-control").first.text_content() == "U+202E"
        assert "\u202e" not in box.text_content()
    prompt_box, output_box = page.locator(".field-prompt_text pre"), page.locator(".field-output_text pre")
    assert prompt_box.text_content().replace("U+202E", "\u202e") == prompt  # the rest as it is, escaped
    # a long output scrolls in a box of capped height
    height, scroll_height = output_box.evaluate("el => [el.clientHeight, el.scrollHeight]")
    assert (
        height < 400 < scroll_height and output_box.evaluate("el => getComputedStyle(el).overflowY") == "auto"
    )
    # read-only: nothing to save; a takedown deletes
    assert page.locator("input[name=_save]").count() == 0 and page.is_visible("a.deletelink")

    page.goto(f"{server.url}/admin/playground/generation/")
    row = page.locator(f"tr:has(a[href*='{generation_id}'])")
    assert row.locator(".field-prompt_excerpt").text_content() == 'role = "userU+202EPQR"  # check'
    assert re.fullmatch(r"[\d,]+\.\d tok/s", row.locator(".field-decode_rate").text_content())
    assert page.evaluate("window.cspViolations") == [] and page.errors == []
