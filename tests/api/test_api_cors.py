"""Cross-origin API calls from a real browser (playground/api/cors.py): a web app the operator names may call
/v1/ with its key; any other origin is refused by the browser, as without the setting."""

from __future__ import annotations

import http.server
import re
import threading

import pytest

from common.redis_server import free_port

pytestmark = pytest.mark.browser


@pytest.fixture
def app_origin():
    """An empty page on another port: a web app of its own origin, as a browser sees it."""

    class EmptyPage(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<!doctype html><title>app</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), EmptyPage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


FETCH = """async ([url, method, body]) => {
    try {
        const response = await fetch(url, {method, body, headers: {
            "Authorization": "Bearer sk-test", "Content-Type": "application/json"}});
        return {status: response.status, json: await response.json(),
                requestId: response.headers.get("x-request-id")};
    } catch (error) {
        return {refused: String(error)};
    }
}"""


def test_only_the_named_web_app_may_call_the_api_from_a_browser(start_web, browser, app_origin):
    allowed = f"http://127.0.0.1:{app_origin}"
    web = start_web(env={"PLAYGROUND_API_CORS_ORIGINS": allowed})
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(allowed + "/")
        models = page.evaluate(FETCH, [web.url + "/v1/models", "GET", None])
        assert models["status"] == 200 and models["json"]["object"] == "list"
        # a POST with a JSON body goes through the preflight; its error is readable too
        bad = page.evaluate(FETCH, [web.url + "/v1/completions", "POST", '{"model": "nope", "prompt": "x"}'])
        assert bad["status"] == 404 and bad["json"]["error"]["code"] == "model_not_found"
        assert re.fullmatch(
            r"[0-9a-f]{32}", bad["requestId"] or ""
        )  # exposed: the app can quote it in a report

        page.goto(f"http://localhost:{app_origin}/")  # the same page on another origin: not named
        refused = page.evaluate(FETCH, [web.url + "/v1/models", "GET", None])
        assert "refused" in refused and "Failed to fetch" in refused["refused"]
    finally:
        context.close()


def test_without_the_setting_no_origin_is_let_in(start_web, browser, app_origin):
    web = start_web()
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"http://127.0.0.1:{app_origin}/")
        assert "refused" in page.evaluate(FETCH, [web.url + "/v1/models", "GET", None])
    finally:
        context.close()
