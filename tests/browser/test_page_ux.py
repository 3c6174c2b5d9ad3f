"""The page past the happy path, as a person meets it in Debian's chromium driven by playwright:
reloads, dropped networks, phones, shortcuts, refusals, limits and share pages.

The stand-in engine echoes the prompt (one character per token), so every output is known exactly;
one test runs the shipped default model, for its real context limit.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from pathlib import Path

import pytest
import redis
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from common.protocol import events_key, job_key
from tests.support import WorkerProcess, e2e_model
from tests.support.page import (
    STANDIN,
    generate,
    new_page,
    open_playground,
    record_state_texts,
    record_states,
    standin_server,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

MODEL = STANDIN
PHONE = {"width": 375, "height": 740}
# a phone as a device: its screen, touch, and three device pixels to a CSS pixel
PHONE_3X = {
    "viewport": {"width": 390, "height": 844},
    "device_scale_factor": 3,
    "is_mobile": True,
    "has_touch": True,
}


@pytest.fixture(scope="module")
def server(redis_server, tmp_path_factory):
    yield from standin_server(redis_server, tmp_path_factory.mktemp("page"))


@pytest.fixture(scope="module")
def default_model(redis_server, tmp_path_factory):
    """A worker of the shipped default model (a 1,024-token context), for the one test that needs it."""
    model = e2e_model()
    if not Path(model).is_dir():
        pytest.skip("KOG_TEST_MODEL names a preset: the test counts tokens with the checkpoint's tokenizer")
    worker = WorkerProcess(redis_server, [model], tmp_path_factory.mktemp("default") / "worker.log")
    worker.wait_ready()
    yield Path(model)
    worker.stop()


@pytest.fixture(scope="module")
def copying_model(redis_server, tmp_path_factory):
    """A worker of the default model whose generation_config.json recommends no repetition penalty: the penalty
    the shipped one recommends keeps a code edit from copying its prompt, which is what drafts are made of."""
    source = Path(e2e_model())
    if not source.is_dir():
        pytest.skip("KOG_TEST_MODEL names a preset: the test needs the checkpoint's drafts to be copies")
    path = tmp_path_factory.mktemp("copying") / "copying"
    shutil.copytree(source, path)
    generation = json.loads((path / "generation_config.json").read_text())
    generation.pop("repetition_penalty", None)
    (path / "generation_config.json").write_text(json.dumps(generation))
    worker = WorkerProcess(redis_server, [str(path)], path.parent / "worker.log")
    worker.wait_ready()
    yield path.name
    worker.stop()


@pytest.fixture(scope="module")
def advised_model(redis_server, tmp_path_factory):
    """A worker of a model whose generation_config.json recommends its sampling (as Qwen3's does)."""
    from inference.synth import synth

    path = synth("tiny-qwen3", tmp_path_factory.mktemp("advised") / "advised", seed=0)
    generation = json.loads((path / "generation_config.json").read_text())
    advice = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 40}
    (path / "generation_config.json").write_text(json.dumps({**generation, **advice}))
    worker = WorkerProcess(redis_server, [str(path)], path.parent / "worker.log")
    worker.wait_ready()
    yield path.name
    worker.stop()


def wait_for_state(page, state: str, timeout: int = 15_000) -> None:
    page.wait_for_selector(f"#state[data-state={state}]", timeout=timeout)


def wait_for_tokens(page, more_than: int) -> None:
    page.wait_for_function(
        f"() => +document.getElementById('tokens').textContent > {more_than}", timeout=15_000
    )


def clipboard(page) -> str:
    return page.evaluate("navigator.clipboard.readText()")


def numbered_lines(count: int, tag: str = "line") -> str:
    return "".join(f"{tag} {i:04d}\n" for i in range(count))


class Proxy:
    """A pass-through for the page's websocket that the test can cut, and keep cut (an outage)."""

    def __init__(self, page):
        self.sockets, self.attempts, self.outage = [], [], False
        page.route_web_socket(re.compile(r".*/ws/generate/$"), self.handle)

    def handle(self, ws):
        self.attempts.append(time.monotonic())
        if self.outage:
            ws.close(code=1011, reason="outage")
            return
        ws.connect_to_server()
        self.sockets.append(ws)

    def cut(self, keep_down: bool) -> None:
        self.outage = keep_down
        self.sockets[-1].close(code=1011, reason="network drop")

    def wait_for_attempts(self, page, count: int, timeout_s: float = 15) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.attempts) < count:
            assert time.monotonic() < deadline, f"only {len(self.attempts)} connection attempts"
            page.wait_for_timeout(50)


# ---- 1. a reload keeps the form and the run ---------------------------------------------------------


def test_a_reload_mid_stream_restores_the_form_and_resumes_the_run(server, page):
    open_playground(page, server.url)
    prompt = numbered_lines(150)  # 1,500 characters, all different: 3.75 s at 400 tokens/s
    page.fill("#temperature", "0.7")
    page.fill("#top-p", "0.8")
    generate(page, prompt, len(prompt))
    wait_for_tokens(page, 100)

    page.reload()
    assert page.input_value("#prompt") == prompt
    assert (page.input_value("#temperature"), page.input_value("#top-p")) == ("0.7", "0.8")
    assert page.input_value("#max-tokens") == str(len(prompt))
    assert page.input_value("#model") == MODEL
    wait_for_state(page, "done")  # the same run, followed to its end: not cancelled, not queued behind
    assert page.text_content("#output") == prompt
    assert page.get_attribute("#output", "data-stream-check") == "ok"
    assert page.text_content("#tokens") == str(len(prompt))
    assert float(page.text_content("#elapsed")) >= 3.0  # timed from the first submit
    share = page.get_attribute("#share", "href")

    page.reload()  # a finished run comes back too, share link and all
    wait_for_state(page, "done")  # shown at once, as it ended; its text follows from the server's replay
    page.wait_for_selector("#output[data-stream-check]", timeout=15_000)  # the replay's done frame came
    assert page.get_attribute("#output", "data-stream-check") == "ok"
    assert page.text_content("#output") == prompt
    assert page.get_attribute("#share", "href") == share
    assert page.errors == []


RECORD_FROM_THE_START = """document.addEventListener("DOMContentLoaded", () => {
    // what the status line says and whether Stop is enabled, from the page's first moment on
    window.stateTexts = [];
    window.stopEnabled = [];
    const state = document.getElementById("state"), stop = document.getElementById("stop");
    new MutationObserver(() => window.stateTexts.push(state.textContent))
        .observe(state, {subtree: true, childList: true, characterData: true});
    new MutationObserver(() => window.stopEnabled.push(!stop.disabled))
        .observe(stop, {attributes: true, attributeFilter: ["disabled"]});
});"""


def test_a_reload_after_a_finished_run_brings_it_back_quietly(server, page):
    open_playground(page, server.url)
    generate(page, "def quiet():\n", 13)
    wait_for_state(page, "done")
    finished = page.text_content("#state")

    page.add_init_script(RECORD_FROM_THE_START)
    page.reload()
    page.wait_for_function("() => document.getElementById('output').textContent === 'def quiet():\\n'")
    page.wait_for_selector("#final-stats", state="visible")
    assert page.text_content("#state") == finished
    # no replay announced as if it ran again ("Reconnecting · restoring…", "Streaming · prefilling…"), and no
    # Stop for a run that has ended
    said = page.evaluate("window.stateTexts")
    assert set(said) <= {finished}, said
    assert page.is_disabled("#stop") and not any(page.evaluate("window.stopEnabled"))
    assert page.errors == []


# ---- 2. reconnecting ------------------------------------------------------------------------------


def test_a_lost_connection_retries_within_seconds_and_at_once_when_the_network_returns(server, page):
    proxy = Proxy(page)
    open_playground(page, server.url)
    page.wait_for_selector("#app[data-connected=true]")
    assert page.is_hidden("#retry")

    started = time.monotonic()
    proxy.cut(keep_down=True)
    page.wait_for_selector("#retry", state="visible", timeout=2_000)
    proxy.wait_for_attempts(page, 7)  # 6 retries: 0.25 + 0.5 + 1 + 2 + 3 + 3 s
    tries = proxy.attempts[1:]
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert tries[0] - started < 1.0 and max(gaps) < 3.6, gaps  # capped at 3 s, not htmx's 64

    proxy.wait_for_attempts(page, 8)
    proxy.outage = False
    page.context.set_offline(True)  # the network comes back: the browser fires `online`
    page.context.set_offline(False)
    back = time.monotonic()
    page.wait_for_selector("#app[data-connected=true]", timeout=5_000)
    assert time.monotonic() - back < 1.0  # the next scheduled try was ~3 s away
    assert page.is_hidden("#retry")

    proxy.cut(keep_down=True)
    proxy.wait_for_attempts(page, 14)
    proxy.outage = False
    clicked = time.monotonic()
    page.click("#retry")
    page.wait_for_selector("#app[data-connected=true]", timeout=5_000)
    assert time.monotonic() - clicked < 1.0
    assert page.errors == []


def forget_job_on_the_server(server, page) -> None:
    """What a server restart does to the page's run (make run's Redis starts empty): its job is gone."""
    job_id = page.evaluate("JSON.parse(sessionStorage.getItem('kog-playground')).job.id")
    r = redis.Redis.from_url(server.env["REDIS_URL"])
    try:
        r.delete(job_key(job_id), events_key(job_id))
    finally:
        r.close()


def test_a_run_the_server_lost_while_disconnected_keeps_its_partial_output_and_says_so(server, page):
    proxy, prompt = long_run_through_a_proxy(server, page)
    record_state_texts(page)
    proxy.cut(keep_down=True)
    wait_for_state(page, "reconnecting")
    forget_job_on_the_server(server, page)
    proxy.outage = False

    wait_for_state(page, "error")
    state = page.text_content("#state")
    assert "lost" in state and "partial output kept" in state, state
    assert not [text for text in page.evaluate("window.stateTexts") if "resumed" in text]  # it never was
    shown = page.text_content("#output")
    assert len(shown) > 50 and prompt.startswith(shown)  # what arrived stays, to read and to copy
    page.click("#copy")
    page.wait_for_selector("#copy:text('Copied')")
    assert clipboard(page) == page.text_content("#output-context") + shown
    assert page.is_enabled("#generate") and page.is_disabled("#stop")


def test_while_the_server_is_unreachable_the_clock_stops_and_copy_is_offered(server, page):
    proxy, prompt = long_run_through_a_proxy(server, page)
    proxy.cut(keep_down=True)
    wait_for_state(page, "reconnecting")
    assert page.text_content("#state").lower().count("reconnect") == 1  # not "Reconnecting · … reconnecting…"
    page.wait_for_function(
        "() => document.getElementById('state').textContent.includes('unreachable')", timeout=10_000
    )  # after a few failed tries
    assert "unreachable" in page.text_content("#worker-status")
    assert page.text_content("#state").lower().count("reconnect") == 1
    assert page.is_visible("#retry") and page.is_visible("#copy")  # what arrived can be copied meanwhile
    clock = page.text_content("#elapsed")
    page.wait_for_timeout(700)
    assert page.text_content("#elapsed") == clock  # no run time the page cannot vouch for

    proxy.outage = False
    page.click("#retry")
    wait_for_state(page, "done", timeout=20_000)  # the run went on on the server: nothing lost
    assert page.text_content("#output") == prompt
    assert float(page.text_content("#elapsed")) > float(clock)


def back_online(page) -> None:
    """Retry now once the outage is over, unless the page's own backoff reconnects first: a few seconds into an
    outage its next try is close, and either may win (the Retry button hides once connected)."""
    with contextlib.suppress(PlaywrightTimeoutError):
        page.click("#retry", timeout=3_000)
    page.wait_for_selector("#app[data-connected=true]")


def test_generate_while_disconnected_waits_for_the_connection_and_stop_cancels_it(server, page):
    proxy = Proxy(page)
    open_playground(page, server.url)
    proxy.cut(keep_down=True)
    page.wait_for_selector("#retry", state="visible")
    generate(page, "def waiting():\n", 15)
    state = page.text_content("#state")
    assert "waiting for the connection" in state and "sends once connected" in state, state
    page.keyboard.press("Escape")
    wait_for_state(page, "cancelled")
    assert "not sent" in page.text_content("#state") and page.is_enabled("#generate")

    proxy.outage = False
    back_online(page)
    page.wait_for_timeout(1_000)
    assert page.get_attribute("#state", "data-state") == "cancelled"  # nothing went out when it came back
    assert page.text_content("#output") == "" and page.text_content("#tokens") == "0"

    proxy.cut(keep_down=True)  # not cancelled: it goes out once connected
    page.wait_for_selector("#retry", state="visible")
    page.click("#generate")
    assert page.get_attribute("#state", "data-state") == "sending"
    proxy.outage = False
    back_online(page)
    wait_for_state(page, "done")
    assert page.text_content("#output") == "def waiting():\n"
    assert page.errors == []


# ---- 3. sharing keeps the playground -----------------------------------------------------------------


def test_share_link_is_copied_and_opens_in_a_new_tab_keeping_the_playground(server, page):
    open_playground(page, server.url)
    generate(page, "def shared():\n    pass\n", 23)
    wait_for_state(page, "done")
    href = page.get_attribute("#share", "href")
    assert re.fullmatch(r"/g/[\w-]+", href)

    page.click("#copy-link")
    page.wait_for_selector("#copy-link:text('Link copied')")
    assert clipboard(page) == server.url + href

    assert page.get_attribute("#share", "target") == "_blank"
    assert "noopener" in page.get_attribute("#share", "rel")
    with page.context.expect_page() as opened:
        page.click("#share")
    shared = opened.value
    shared.wait_for_load_state()
    assert shared.url == server.url + href
    assert page.url.rstrip("/") == server.url  # the playground stays where it was, run and all
    assert page.text_content("#output") == "def shared():\n    pass\n"
    assert page.get_attribute("#state", "data-state") == "done"


def test_copying_is_announced_and_the_output_takes_the_keyboard_focus(server, page):
    open_playground(page, server.url)
    generate(page, "def announced():\n", 9)
    wait_for_state(page, "done")
    page.click("#copy")  # a button's new label alone is not read out
    page.wait_for_selector("#copy-status:text-is('Copied')", state="attached")  # off-screen, still read out
    assert page.get_attribute("#copy-status", "role") == "status"
    # the output box is a named region the keyboard can reach (to scroll a long output), in every browser
    page.focus("#output-box")
    assert page.evaluate("document.activeElement.id") == "output-box"
    assert page.get_attribute("#output-box", "aria-label") == "Output"


def test_copy_code_takes_the_fenced_blocks_without_the_words_around_them(server, page):
    open_playground(page, server.url)
    answer = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nAnd the test:\n```\nassert add(1, 2) == 3\n```\nDone.\n"
    code = "def add(a, b):\n    return a + b\n\nassert add(1, 2) == 3\n"
    generate(page, answer, len(answer))  # the stand-in echoes it
    wait_for_state(page, "done")
    page.click("#copy-code")
    page.wait_for_selector("#copy-code:text('Copied')")
    assert clipboard(page) == code
    page.goto(server.url + page.get_attribute("#share", "href"))  # the share page offers the same
    page.click("#copy-code")
    page.wait_for_selector("#copy-code:text('Copied')")
    assert clipboard(page) == code

    page.goto(server.url)  # an answer without fences has no code apart from its words
    open_playground(page, server.url)
    generate(page, "def plain():\n", 12)
    wait_for_state(page, "done")
    assert page.is_visible("#copy") and page.is_hidden("#copy-code")
    page.goto(server.url + page.get_attribute("#share", "href"))
    assert page.is_hidden("#copy-code")


# An answer's fenced code as CommonMark reads it -> what Copy code takes
FENCED = [
    ("two blocks", "Here:\n```python\ndef f():\n    return 1\n```\nAnd:\n```\nassert f()\n```\nDone.\n",
     "def f():\n    return 1\n\nassert f()\n"),
    ("a run stopped inside a block", "Intro\n```python\nprint(1)\n", "print(1)\n"),
    ("a closed block, then an open one", "```\none()\n```\ntext\n```\ntwo()\n", "one()\n\ntwo()\n"),
    ("a longer fence around a shorter one", "````md\nHere:\n```python\nprint(1)\n```\n````\n",
     "Here:\n```python\nprint(1)\n```\n"),
    ("indented in a list", "1. step\n   ```bash\n   ls\n   ```\n", "   ls\n"),
    ("tildes", "~~~\nx = 1\n~~~\n", "x = 1\n"),
    ("inline code at a line's start", "```js``` is how you start\nThen text.\n```\nreal()\n```\n", "real()\n"),
    ("CRLF", "a\r\n```\r\nprint(1)\r\n```\r\n```\r\nz\r\n```\r\n", "print(1)\r\n\r\nz\r\n"),
    ("no fences", "no fences here\n", ""),
    ("backticks inside the code", "```\ncode ``` inside\n```", "code ``` inside\n"),
]  # fmt: skip


def test_copy_code_reads_fences_as_commonmark_does(server, page):
    open_playground(page, server.url)
    got = page.evaluate("cases => cases.map(([, text]) => window.kogHighlight.fencedCode(text))", FENCED)
    assert {name: code for (name, _, _), code in zip(FENCED, got, strict=True)} == {
        name: want for name, _, want in FENCED
    }


def test_back_to_the_playground_after_try_it_yourself_brings_its_own_run_back(server, page):
    open_playground(page, server.url)
    generate(page, "def mine():\n", 12)
    wait_for_state(page, "done")
    share = page.get_attribute("#share", "href")

    page.goto(server.url + share)  # the same tab: the share page, then Try it yourself
    page.click("#try-it")
    page.wait_for_selector("#worker-status[data-up=true]", timeout=15_000)
    page.fill("#prompt", "def tried():\n")  # the try-it entry's own edits
    page.wait_for_timeout(500)  # saved once the typing pauses

    page.go_back()
    page.go_back()  # the first playground entry: its run, its form
    page.wait_for_selector("#state[data-state=done]", timeout=15_000)
    assert page.input_value("#prompt") == "def mine():\n"
    assert page.text_content("#output") == "def mine():\n"
    assert page.get_attribute("#share", "href") == share
    page.go_forward()
    page.go_forward()  # and the try-it entry keeps its own
    page.wait_for_selector("#worker-status[data-up=true]", timeout=15_000)
    assert page.input_value("#prompt") == "def tried():\n"
    assert page.errors == []


def test_the_copy_announcer_is_there_before_the_first_copy(server, page):
    # a live region made at the moment it speaks is often missed by screen readers
    open_playground(page, server.url)
    assert page.get_attribute("#copy-status", "role") == "status"
    generate(page, "def announced():\n", 9)
    wait_for_state(page, "done")
    page.goto(server.url + page.get_attribute("#share", "href"))
    assert page.get_attribute("#copy-status", "role") == "status"


# ---- 4. on a phone ---------------------------------------------------------------------------------


def test_on_a_phone_generate_brings_the_live_output_into_view(server, browser):
    page = new_page(browser, viewport=PHONE, is_mobile=True, has_touch=True)
    try:
        open_playground(page, server.url)
        assert page.is_hidden("#generate .shortcut")  # no Ctrl ↵ to advertise on a touch screen
        page.fill("#prompt", numbered_lines(200))
        page.fill("#max-tokens", "2000")
        page.evaluate("window.scrollTo(0, 0)")
        page.tap("#generate")
        wait_for_tokens(page, 20)
        page.wait_for_timeout(600)  # the smooth scroll
        output = page.locator("#output-box").bounding_box()
        topbar, bar = page.locator(".topbar").bounding_box(), page.locator("#actions").bounding_box()
        # the whole box, between the top bar and the run bar (which shows the speed the meters above show)
        assert topbar["height"] <= output["y"] and output["y"] + output["height"] <= bar["y"], (output, bar)
        # and nothing covers it (a sticky form did): what is under the output's visible middle is the output
        x, y = output["x"] + output["width"] / 2, (output["y"] + PHONE["height"]) / 2
        assert page.evaluate("([x, y]) => !!document.elementFromPoint(x, y).closest('#output-box')", [x, y])
        page.tap("#stop")
        wait_for_state(page, "stopped")

        for selector in ("#copy-link", "#share", "#copy", "#worker-status"):
            box = page.locator(selector).bounding_box()
            assert box["height"] < 40, (selector, box)  # one line each, not wrapped
            assert box["x"] + box["width"] <= PHONE["width"], (selector, box)
        assert page.errors == []
    finally:
        page.context.close()


def test_the_shortcut_hint_shows_on_a_desktop(server, page):
    open_playground(page, server.url)
    assert page.is_visible("#generate .shortcut")


def on_top(page, selector: str, x: float, y: float) -> bool:
    """Whether the element under the point (x, y) of the screen is selector's, i.e. nothing covers it there."""
    return page.evaluate("([s, x, y]) => !!document.elementFromPoint(x, y)?.closest(s)", [selector, x, y])


def test_on_a_phone_stop_and_the_live_speed_stay_on_screen_while_the_output_streams(server, browser):
    page = new_page(browser, **PHONE_3X)
    width, height = PHONE_3X["viewport"]["width"], PHONE_3X["viewport"]["height"]
    try:
        open_playground(page, server.url)
        long_line = "x = [" + ", ".join(f"'item_{i}'" for i in range(60)) + "]\n"  # 700 characters
        page.fill("#prompt", long_line + numbered_lines(300))
        page.fill("#max-tokens", "3000")
        page.tap("#generate")
        wait_for_tokens(page, 50)
        # wherever the person has scrolled to while it streams: the form, the output, the page's end
        for scroll in ("document.getElementById('output-box').offsetTop", "document.body.scrollHeight", "0"):
            page.evaluate(f"window.scrollTo(0, {scroll})")
            stop = page.locator("#stop").bounding_box()
            assert page.is_enabled("#stop") and 0 <= stop["y"] <= height - stop["height"], stop
            assert on_top(page, "#stop", stop["x"] + stop["width"] / 2, stop["y"] + stop["height"] / 2)
            speed = page.locator("#run-tok-s").bounding_box()
            assert speed and 0 <= speed["y"] <= height - speed["height"], speed
        assert float(page.text_content("#run-tok-s")) > 0 and int(page.text_content("#run-tokens")) > 50
        # at the page's end the output's last lines sit above the bar, not under it
        page.evaluate("window.scrollTo(0, document.body.scrollHeight)")
        box, bar = page.locator("#output-box").bounding_box(), page.locator("#actions").bounding_box()
        assert box["y"] + box["height"] <= bar["y"], (box, bar)
        assert on_top(page, "#output-box", box["x"] + box["width"] / 2, box["y"] + box["height"] - 10)
        assert page.evaluate("document.documentElement.scrollWidth") <= width  # long lines wrap

        page.evaluate("window.scrollTo(0, document.getElementById('output-box').offsetTop)")
        reading = page.evaluate("window.scrollY")
        page.tap("#stop")
        wait_for_state(page, "stopped")
        # the focus goes back to Generate, far above, and the page stays where the person reads
        page.wait_for_function("() => document.activeElement.id === 'generate'", timeout=5_000)
        assert abs(page.evaluate("window.scrollY") - reading) < 80, (reading, page.evaluate("window.scrollY"))
        assert page.is_hidden("#run-tok-s")  # the bar is gone with the run; the actions are back in the form
        assert (
            page.is_visible("#generate")
            and page.locator("#actions").evaluate("el => getComputedStyle(el).position") != "fixed"
        )
        assert page.errors == []
    finally:
        page.context.close()


@pytest.mark.parametrize("width", [960, 1024, 1280])
def test_the_meters_hold_their_numbers_at_every_desktop_width(server, browser, width):
    page = new_page(browser, viewport={"width": width, "height": 860})
    try:
        open_playground(page, server.url)
        generate(page, "x", 1000)  # four-digit counts: "1000 tok"
        wait_for_state(page, "done")
        overflowing = page.evaluate("""() => Array.from(document.querySelectorAll(".meter"))
            .filter((m) => m.scrollWidth > m.clientWidth || m.getBoundingClientRect().right >
                           document.querySelector(".meters").getBoundingClientRect().right + 0.5)
            .map((m) => m.textContent.trim())""")
        assert overflowing == [], overflowing
    finally:
        page.context.close()


def test_a_one_token_run_says_it_has_no_decode_rate(server, page):
    open_playground(page, server.url)
    generate(page, "x", 1)
    wait_for_state(page, "done")
    assert page.text_content("#stat-decode") == "– · 1 token"
    page.goto(server.url + page.get_attribute("#share", "href"))
    assert re.search(r"Decode\s*–", page.text_content(".final-stats:not(#params)")), page.text_content("main")


# ---- 4b. following the output ------------------------------------------------------------------------

BOX_GAP = "() => { const b = document.getElementById('output-box'); return b.scrollHeight - b.scrollTop - b.clientHeight; }"


def test_a_completion_after_a_long_prompt_streams_into_view_and_a_reader_who_scrolls_up_stays(server, page):
    open_playground(page, server.url)
    prompt = numbered_lines(300)  # shown dimmed before the completion: 300 lines, far taller than the box
    generate(page, prompt, len(prompt))
    wait_for_tokens(page, 100)
    assert page.evaluate(BOX_GAP) < 48  # the box follows the newest lines, not the prompt's first ones

    page.evaluate("document.getElementById('output-box').scrollTop = 0")  # back to the prompt, to read it
    wait_for_tokens(page, 400)
    assert page.evaluate("document.getElementById('output-box').scrollTop") == 0  # left where they are
    page.click("#stop")
    wait_for_state(page, "stopped")


# ---- 4c. contrast ------------------------------------------------------------------------------------

# An element's text colour, and its background's colours (a gradient's stops, or the nearest solid one).
COLOURS = """([selector, pseudo]) => {
    const element = document.querySelector(selector);
    const colours = (text) => text.match(/rgba?\\([^)]*\\)/g) || [];
    let background = [];
    for (let node = element; node && !background.length; node = node.parentElement) {
        const style = getComputedStyle(node);
        background = colours(style.backgroundImage);
        if (!background.length && style.backgroundColor !== "rgba(0, 0, 0, 0)") background = [style.backgroundColor];
    }
    return [getComputedStyle(element, pseudo).color, background];
}"""


def contrast(first: str, second: str) -> float:
    """WCAG 2's contrast ratio of two CSS rgb() colours."""

    def luminance(colour: str) -> float:
        channels = [int(value) / 255 for value in re.findall(r"[\d.]+", colour)[:3]]
        linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    high, low = sorted((luminance(first), luminance(second)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_the_pages_words_read_at_4_5_to_1_against_their_background(server, page):
    open_playground(page, server.url)
    texts = [
        ("#generate", ""),
        ("#output", "::before"),
        ("#state", ""),
        (".field-label", ""),
        (".meter-label", ""),
    ]
    for selector, pseudo in texts:
        colour, background = page.evaluate(COLOURS, [selector, pseudo or None])
        worst = min(contrast(colour, stop) for stop in background)
        assert worst >= 4.5, (selector, pseudo, colour, background, worst)
    page.hover("#generate")
    colour, background = page.evaluate(COLOURS, ["#generate", None])
    assert min(contrast(colour, stop) for stop in background) >= 4.5, ("hovered", colour, background)


# ---- 4d. screen readers and motion ------------------------------------------------------------------


def test_one_heading_one_output_landmark_and_a_generate_button_named_generate(server, page):
    open_playground(page, server.url)
    assert page.get_by_role("heading", level=1).count() == 1
    assert page.get_by_role("region", name="Output").count() == 1  # not a region inside a region
    generate_button = page.get_by_role("button", name="Generate", exact=True)  # not "Generate Ctrl ↵"
    assert generate_button.count() == 1
    assert "Control+Enter" in generate_button.get_attribute("aria-keyshortcuts")
    assert page.text_content("#generate .shortcut") == "Ctrl↵"
    assert page.get_attribute("#max-tokens", "aria-describedby") == "token-hint"


def test_on_a_mac_the_shortcut_shows_the_command_key(server, browser):
    page = new_page(browser)
    try:
        page.add_init_script(
            "Object.defineProperty(Navigator.prototype, 'platform', {get: () => 'MacIntel'})"
        )
        open_playground(page, server.url)
        assert page.text_content("#generate .shortcut") == "⌘↵"
    finally:
        page.context.close()


ANIMATIONS = """() => Object.fromEntries([
    ["brand", getComputedStyle(document.querySelector(".brand-mark"))],
    ["state", getComputedStyle(document.getElementById("state"), "::before")],
    ["cursor", getComputedStyle(document.getElementById("output"), "::after")],
].map(([name, style]) => [name, [style.animationName, style.animationIterationCount]]))"""


@pytest.mark.parametrize("motion", ["reduce", "no-preference"])
def test_nothing_blinks_on_and_on_and_nothing_moves_for_those_who_ask_for_less(server, browser, motion):
    page = new_page(browser, reduced_motion=motion)
    try:
        open_playground(page, server.url)
        generate(page, numbered_lines(100), 1000)
        wait_for_tokens(page, 10)  # the state's dot pulses and the cursor blinks while it streams
        animations = page.evaluate(ANIMATIONS)
        page.click("#stop")
        wait_for_state(page, "stopped")
        if motion == "reduce":
            assert all(name == "none" for name, _ in animations.values()), animations
        else:  # the brand's cursor blinks a few times as the page opens, then holds still
            assert animations["brand"][0] != "none" and animations["brand"][1] != "infinite", animations
            assert animations["cursor"][0] != "none", animations
    finally:
        page.context.close()


# ---- 5, 6. Python is highlighted as Python; a completion comes with its prompt ---------------------

# Alone, these lines read as Ruby to highlight.js's guess; they are Python.
PYTHON = "    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n"


def test_python_output_is_highlighted_as_python(server, page):
    open_playground(page, server.url)
    generate(page, PYTHON, len(PYTHON))
    wait_for_state(page, "done")
    assert page.get_attribute("#output", "data-language") == "python"
    assert page.locator("#output .hljs-keyword", has_text="def").count() == 2


def test_a_very_long_output_stays_plain_text_so_the_page_does_not_freeze_when_it_ends(server, page):
    open_playground(page, server.url)
    spans = page.evaluate(
        """(sizes) => sizes.map((size) => {
            const code = document.createElement("code");
            const text = "def f(x):\\n    return x  # ok\\n".repeat(Math.ceil(size / 10)).slice(0, size);
            window.kogHighlight.render(code, text, {});
            return [text.length === size && code.textContent === text, code.querySelectorAll("span").length];
        })""",
        [2_000, 60_001],
    )
    assert spans[0][0] and spans[0][1] > 0  # highlighted, the text intact
    assert spans[1] == [True, 0]  # over the cap: one text node, no second-long parse at the run's end


def test_a_completion_is_shown_and_copied_after_the_prompt_it_continues(server, page):
    open_playground(page, server.url)
    page.click("#system-details summary")
    page.fill("#system-prompt", "import os")
    prompt = "def here():\n    return os.getcwd()\n"
    generate(page, prompt, len(prompt))
    wait_for_state(page, "done")
    context = "import os\n\n" + prompt  # what a completion model reads: system prompt, blank line, prompt
    echoed = (context * 2)[: len(prompt)]  # the stand-in echoes the text it was given
    assert page.text_content("#output-context") == context
    assert page.text_content("#output") == echoed
    opacity = page.eval_on_selector("#output-context", "el => getComputedStyle(el).opacity")
    assert float(opacity) < 1  # dimmed: the prompt is not the model's
    assert page.locator("#output-context .hljs-keyword").count() > 0  # highlighted with the answer

    page.click("#copy")
    page.wait_for_selector("#copy:text('Copied')")
    assert clipboard(page) == context + echoed  # runnable as it is


# ---- 7. a refused request keeps what was there ------------------------------------------------------


def test_on_a_phone_a_refused_field_is_brought_into_view(server, browser):
    phone = new_page(browser, **PHONE_3X)
    try:
        open_playground(phone, server.url)
        generate(phone, "   ", 5)  # refused by the server: a prompt of blanks (the output was scrolled to)
        wait_for_state(phone, "error")
        phone.wait_for_timeout(800)  # any smooth scroll has ended
        box = phone.evaluate("(() => { const r = document.getElementById('prompt').getBoundingClientRect();"
                             " return {top: r.top, bottom: r.bottom, height: innerHeight}; })()")  # fmt: skip
        assert box["bottom"] > 0 and box["top"] < box["height"], box
        assert phone.evaluate("document.activeElement.id") == "prompt"
        assert "prompt" in phone.text_content("#prompt-error") and phone.is_visible("#prompt-error")
        phone.fill("#prompt", "def fine():\n")  # editing the prompt clears what was said of it
        assert phone.is_hidden("#prompt-error")
    finally:
        phone.context.close()


def test_a_refused_request_keeps_the_last_output(server, page):
    open_playground(page, server.url)
    generate(page, "def kept():\n", 12)
    wait_for_state(page, "done")
    share = page.get_attribute("#share", "href")

    generate(page, "   \n  ", 10)  # the server refuses a prompt of blanks
    wait_for_state(page, "error")
    assert "prompt" in page.text_content("#state")
    assert page.text_content("#output") == "def kept():\n"
    assert page.is_visible("#copy") and page.get_attribute("#share", "href") == share
    assert page.is_visible("#final-stats")

    generate(page, "def next_one():\n", 16)  # an accepted request clears it
    wait_for_state(page, "done")
    assert page.text_content("#output") == "def next_one():\n"


def test_a_blank_prompt_is_refused_in_the_pages_words_for_eyes_and_screen_readers(server, page):
    open_playground(page, server.url)
    generate(page, "  \n ", 5)
    wait_for_state(page, "error")
    said = page.text_content("#prompt-error")
    assert "blank" in said and "non-empty string" not in said, said  # the page's words, not the API's
    assert page.text_content("#state") == f"Error · {said}"
    assert page.get_attribute("#prompt", "aria-invalid") == "true"
    assert (
        "prompt-error" in page.get_attribute("#prompt", "aria-describedby").split()
    )  # its words, read with it

    page.fill("#prompt", "def fine():\n")  # editing what was refused: the refusal goes
    assert page.get_attribute("#prompt", "aria-invalid") is None and page.is_hidden("#prompt-error")
    assert page.text_content("#state") == "Ready"


def rate_limited_server(page, retry_after_s: int) -> None:
    """The page's websocket, with every generate frame refused as over the rate limit (as daphne would)."""

    def handle(ws):
        server = ws.connect_to_server()

        def from_page(message):
            if '"generate"' not in message:
                return server.send(message)
            words = (
                f"Rate limit reached: 1 requests per minute per IP address; try again in {retry_after_s} s"
            )
            refusal = {
                "type": "error",
                "code": "rate_limited",
                "message": words,
                "retry_after_s": retry_after_s,
            }
            ws.send(json.dumps(refusal))

        ws.on_message(from_page)

    page.route_web_socket(re.compile(r".*/ws/generate/$"), handle)


def test_a_rate_limits_try_again_in_counts_down_and_says_when_it_is_time(server, page):
    rate_limited_server(page, retry_after_s=2)
    open_playground(page, server.url)
    generate(page, "def limited():\n", 10)
    wait_for_state(page, "error")
    assert page.text_content("#state").endswith("try again in 2 s")
    page.wait_for_function("() => document.getElementById('state').textContent.endsWith('try again in 1 s')")
    assert page.get_attribute("#state", "aria-busy") == "true"  # the ticks are not read out, one a second
    page.wait_for_function(
        "() => document.getElementById('state').textContent.endsWith('you can try again now')"
    )
    assert page.get_attribute("#state", "aria-busy") is None  # the last words are
    assert page.text_content("#state").startswith("Error · Rate limit reached: 1 requests per minute")


# ---- 8. the context limit ------------------------------------------------------------------------


def prompt_of_tokens(model_dir: Path, low: int, high: int) -> str:
    """Python code that the default model's chat template and tokenizer make `low`..`high` tokens."""
    from inference.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    lines = []
    for i in range(2000):
        lines.append(f"value_{i} = compute(value_{i - 1}, {i})\n" if i else "import math\n")
        text = "".join(lines)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        count = len(tokenizer.encode(rendered, add_special=False))
        if low <= count <= high:
            return text
        assert count < low, f"no prompt of {low}..{high} tokens"
    raise AssertionError("the prompt never grew long enough")


def test_the_context_limit_caps_max_tokens_and_is_named_when_reached(server, default_model, page):
    name = default_model.name
    open_playground(page, server.url, model=name)
    page.wait_for_function("() => document.getElementById('max-tokens').max === '1023'")
    assert "1,024 tokens" in page.text_content("#token-hint")

    page.fill("#prompt", "import os\n")
    page.fill("#max-tokens", "2000")
    assert "warn" in page.get_attribute("#token-hint", "class")
    page.click("#generate")
    page.wait_for_timeout(300)
    assert page.get_attribute("#state", "data-state") == "idle"  # not sent: the field says why
    assert page.eval_on_selector("#max-tokens", "el => el.validity.rangeOverflow")

    page.fill("#temperature", "0")
    generate(page, prompt_of_tokens(default_model, 990, 1010), 200)  # room for at most 34 new tokens
    wait_for_state(page, "done", timeout=60_000)
    stats = page.text_content("#stat-prompt-tokens"), page.text_content("#stat-decode")
    if "end of answer" in page.text_content("#state"):
        pytest.skip(f"the model ended its answer before the context filled: {stats}")
    assert "context full" in page.text_content("#state") and "1,024" in page.text_content("#state"), stats
    assert "max tokens" not in page.text_content("#state")
    assert page.is_hidden("#follow-up")  # a follow-up on a full context could only be refused


def test_a_prompt_over_the_context_leaves_the_last_answer_and_says_why_under_the_prompt(
    server, default_model, browser
):
    phone = new_page(browser, **PHONE_3X)  # on a phone the prompt is far above the output
    try:
        open_playground(phone, server.url, model=default_model.name)
        generate(phone, "def a():", 10)
        wait_for_state(phone, "done", timeout=60_000)
        answer = phone.text_content("#output"), phone.text_content("#output-context")
        share, stats = phone.get_attribute("#share", "href"), phone.text_content("#final-stats")

        generate(phone, "# " + "word " * 3000, 10)  # refused by the worker: over the model's 1,024 tokens
        wait_for_state(phone, "error", timeout=60_000)
        assert "token context" in phone.text_content("#state")
        # said under the prompt, and the page stays there (not carried off to the output, far below)
        phone.wait_for_timeout(800)  # any smooth scroll has ended
        error = phone.evaluate("(() => { const r = document.getElementById('prompt-error').getBoundingClientRect();"
                               " return {top: r.top, bottom: r.bottom, height: innerHeight}; })()")  # fmt: skip
        assert error["top"] > 0 and error["bottom"] < error["height"], error
        assert "token context" in phone.text_content("#prompt-error")
        assert phone.evaluate("document.activeElement.id") == "prompt"
        assert phone.get_attribute("#prompt", "aria-invalid") == "true"

        # the last answer stays, whole: its text (not the refused prompt as context), Copy, link and stats
        assert (phone.text_content("#output"), phone.text_content("#output-context")) == answer
        assert phone.get_attribute("#share", "href") == share and phone.is_visible("#share-actions")
        assert phone.is_visible("#final-stats") and phone.text_content("#final-stats") == stats
        phone.click("#copy")
        phone.wait_for_selector("#copy:text('Copied')")
        assert clipboard(phone) == answer[1] + answer[0]
        assert phone.errors == []
    finally:
        phone.context.close()


def test_on_a_phone_code_keeps_its_lines_and_a_follow_up_keeps_the_form_on_the_screen(
    server, default_model, browser
):
    page = new_page(browser, viewport=PHONE, is_mobile=True, has_touch=True)
    try:
        open_playground(page, server.url, model=default_model.name)
        page.fill("#temperature", "0")
        generate(page, "def greet(name):\n", 24)
        wait_for_state(page, "done", timeout=60_000)
        # a base model's answer is code: its lines stay whole (a wrapped one would start at column 0)
        assert page.get_attribute("#output-box", "data-code") == "true"
        assert page.evaluate("getComputedStyle(document.getElementById('output-box')).whiteSpace") == "pre"
        page.tap("#follow-up")
        # the note under a phone's narrow label row: on a line of its own, the form within the screen
        assert "follows up on 1 earlier turn" in page.text_content("#conversation-note")
        assert (
            page.locator("#conversation-count").bounding_box()["height"] < 30
        )  # one line, not a word a line
        form = page.locator("#prompt-form").bounding_box()
        assert form["x"] + form["width"] <= PHONE["width"], form
        assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        # what a base model does with a follow-up, as the hint under the prompt says: it goes on with the code
        assert (
            page.get_attribute("#prompt", "placeholder")
            == "More code: the model continues after the earlier turns."
        )
        assert page.is_visible("#base-hint")
        assert page.errors == []
    finally:
        page.context.close()


# ---- 8b. a conversation --------------------------------------------------------------------------


def test_a_follow_up_sends_the_earlier_turns_keeps_them_over_a_reload_and_a_new_chat_drops_them(
    server, default_model, page
):
    from inference.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(default_model)

    def prompt_tokens(messages: list[dict]) -> str:  # as the page shows them, counted here independently
        return f"{len(tokenizer.encode(tokenizer.apply_chat_template(messages), add_special=False)):,} tokens"

    open_playground(page, server.url, model=default_model.name)
    page.fill("#temperature", "0")
    assert (
        page.is_hidden("#conversation")
        and page.is_hidden("#conversation-note")
        and page.is_hidden("#follow-up")
    )
    first_prompt, follow_up = "def greet(name):\n", "# now say goodbye to <b>everyone</b>\n"
    generate(page, first_prompt, 24)
    wait_for_state(page, "done", timeout=60_000)
    first_answer = page.text_content("#output")
    assert first_answer and page.is_visible("#follow-up")

    page.click("#follow-up")  # the exchange moves into the earlier turns; the prompt box waits for the next
    assert page.text_content("#conversation-summary") == "Earlier turns · 1"
    assert page.locator("#conversation-turns .turn-speaker").all_text_contents() == ["You", "Model"]
    assert page.locator("#conversation-turns pre").all_text_contents() == [first_prompt, first_answer]
    # the answer keeps its highlighting (as text nodes in spans), the prompt stays plain
    assert page.locator("#conversation-turns .answer-box code.hljs span").count() > 0
    assert page.locator("#conversation-turns pre:not(.answer-box) span").count() == 0
    assert "follows up on 1 earlier turn" in page.text_content("#conversation-note")
    assert page.input_value("#prompt") == "" and page.evaluate("document.activeElement.id") == "prompt"
    assert (
        page.text_content("#output") == ""
        and page.is_hidden("#follow-up")
        and page.is_hidden("#share-actions")
    )

    page.reload()  # the conversation belongs to the tab: a reload keeps it
    page.wait_for_selector("#worker-status[data-up=true]", timeout=15_000)
    assert page.locator("#conversation-turns pre").all_text_contents() == [first_prompt, first_answer]
    # the follow-up's placeholder is the base model's, once the workers said which kind it is
    page.wait_for_function(
        "() => document.getElementById('prompt').placeholder.startsWith('More code:')", timeout=15_000
    )
    generate(page, follow_up, 8)
    wait_for_state(page, "done", timeout=60_000)
    turns = [
        {"role": "user", "content": first_prompt},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": follow_up},
    ]
    # the model read all three; the worker's KV cache still held the first turn and its answer: not prefilled
    read, cached = page.text_content("#stat-prompt-tokens").split(", ")
    assert read == prompt_tokens(turns) and cached.endswith(" cached")
    assert 0 < int(cached.removesuffix(" cached").replace(",", "")) < int(read.split()[0].replace(",", ""))
    share = page.get_attribute("#share", "href")

    page.fill("#prompt", "# a third question, typed before Follow up\n")
    page.click("#follow-up")  # keeps what was typed since the run
    assert page.input_value("#prompt") == "# a third question, typed before Follow up\n"
    assert page.text_content("#conversation-summary") == "Earlier turns · 2"

    page.goto(server.url + share)  # the share page has the whole conversation
    assert page.locator("#share-turns pre").all_text_contents() == [first_prompt, first_answer]
    assert page.locator("#share-turns .answer-box code.hljs span").count() > 0
    assert page.text_content("#share-prompt") == follow_up
    page.click("#try-it")  # ... and offers it again, ready for another follow-up
    page.wait_for_selector("#worker-status[data-up=true]", timeout=15_000)
    assert page.input_value("#prompt") == follow_up
    assert page.locator("#conversation-turns pre").all_text_contents() == [first_prompt, first_answer]
    # the tab's own last run is no part of the shared conversation: it is not brought back under it
    page.wait_for_timeout(500)
    assert page.text_content("#output") == "" and page.is_hidden("#follow-up")
    assert page.get_attribute("#state", "data-state") == "idle"

    page.click("#new-chat")
    assert page.is_hidden("#conversation") and page.is_hidden("#conversation-note")
    assert page.evaluate("document.activeElement.id") == "prompt"
    page.click("#generate")
    wait_for_state(page, "done", timeout=60_000)
    assert page.text_content("#stat-prompt-tokens") == prompt_tokens(turns[-1:])
    assert page.locator("#conversation-turns li").count() == 0
    assert page.errors == []


def test_a_conversation_past_the_context_is_refused_with_the_way_out(server, default_model, page):
    long_turn = {"prompt": prompt_of_tokens(default_model, 1030, 1100), "answer": "pass"}
    stored = json.dumps({"form": {"model": default_model.name}, "conversation": [long_turn]})
    # a conversation that grew past the model's 1,024 tokens, as the tab keeps it (set before the page loads)
    page.add_init_script(f"sessionStorage.setItem('kog-playground', {json.dumps(stored)})")
    open_playground(page, server.url, model=default_model.name)
    assert page.text_content("#conversation-summary") == "Earlier turns · 1"
    generate(page, "# and then?\n", 8)
    wait_for_state(page, "error", timeout=60_000)
    state = page.text_content("#state")
    assert "1,024-token context" in state or "1024-token context" in state, state
    assert "New chat (or a shorter prompt) makes room" in state and "messages" not in state  # not the page's
    assert "no longer fits" in page.text_content("#prompt-error") and page.is_visible("#prompt-error")
    page.click("#new-chat")
    assert page.get_attribute("#state", "data-state") == "idle" and page.is_hidden("#prompt-error")
    generate(page, prompt_of_tokens(default_model, 1030, 1100), 8)  # a prompt the context cannot hold alone
    wait_for_state(page, "error", timeout=60_000)
    state = page.text_content("#state")
    assert "prompt:" in state and "token context" in state and "messages" not in state, state
    assert page.text_content("#prompt-error") == state.split(" · ", 1)[1]
    page.fill("#prompt", "# and then?\n")
    page.click("#generate")
    wait_for_state(page, "done", timeout=60_000)
    assert page.errors == []


def test_a_completion_model_offers_no_follow_up(server, page):
    open_playground(page, server.url)
    generate(page, "def echo():\n", 12)
    wait_for_state(page, "done")
    assert page.is_visible("#copy") and page.is_hidden("#follow-up")


def store_conversation(page, turns: list[dict]) -> None:
    """The tab keeps a conversation, as a reload finds it (set before the page loads)."""
    stored = json.dumps({"form": {"model": MODEL}, "conversation": turns})
    page.add_init_script(f"sessionStorage.setItem('kog-playground', {json.dumps(stored)})")


LONG_CONVERSATION = [
    {"prompt": f"question {i}", "answer": "".join(f"answer {i} line {j}\n" for j in range(8))}
    for i in range(6)
]


def test_earlier_answers_sit_in_their_box_without_a_second_box_inside(server, page):
    store_conversation(page, LONG_CONVERSATION[:1])
    open_playground(page, server.url)
    code = page.locator("#conversation-turns .answer-box code.hljs").first
    style = code.evaluate("el => [getComputedStyle(el).padding, getComputedStyle(el).backgroundColor]")
    assert style == ["0px", "rgba(0, 0, 0, 0)"], style  # highlight.js's theme gives it 1em and #0d1117


def test_after_a_reload_the_earlier_turns_show_the_latest(server, page):
    store_conversation(page, LONG_CONVERSATION)
    open_playground(page, server.url)
    turns = page.evaluate(
        "(() => { const t = document.getElementById('conversation-turns');"
        " return [t.scrollTop, t.clientHeight, t.scrollHeight]; })()"
    )
    top, height, full = turns
    assert full > height and top + height >= full - 2, turns  # scrolled to its end, not left at the top


def test_new_chat_waits_while_a_run_is_built_on_the_earlier_turns(server, page):
    open_playground(page, server.url)
    generate(page, numbered_lines(100), 1000)
    wait_for_tokens(page, 10)
    assert page.is_disabled("#new-chat")
    page.click("#stop")
    wait_for_state(page, "stopped")
    assert page.is_enabled("#new-chat")


# ---- 9. keys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["#temperature", "#max-tokens", "#model", "#system-prompt"])
def test_ctrl_enter_generates_from_any_field_and_escape_stops(server, page, field):
    open_playground(page, server.url)
    page.fill("#prompt", numbered_lines(100))
    page.fill("#max-tokens", "1000")
    if field == "#system-prompt":
        page.click("#system-details summary")
    page.focus(field)
    page.keyboard.press("Control+Enter")
    wait_for_tokens(page, 10)
    page.keyboard.press("Escape")
    wait_for_state(page, "stopped")
    assert int(page.text_content("#tokens")) < 1000


def test_enter_in_a_number_field_does_not_start_a_run(server, page):
    open_playground(page, server.url)
    page.fill("#prompt", "def not_yet():\n")
    for field in ("#temperature", "#top-p", "#max-tokens"):
        page.focus(field)
        page.keyboard.press("Enter")  # someone adjusting a value, not asking for a run
    page.wait_for_timeout(500)
    assert page.get_attribute("#state", "data-state") == "idle" and page.text_content("#output") == ""
    page.keyboard.press("Control+Enter")  # the shortcut still generates from there
    wait_for_state(page, "done")


def test_the_keyboard_focus_goes_from_generate_to_stop_and_back(server, page):
    open_playground(page, server.url)
    page.fill("#prompt", numbered_lines(100))
    page.fill("#max-tokens", "1000")
    page.focus("#generate")
    page.keyboard.press("Enter")
    # Generate is disabled under the focus: the focus moves on to Stop, not back to the top of the page
    page.wait_for_function("() => document.activeElement.id === 'stop'", timeout=10_000)
    assert page.evaluate("document.activeElement.matches(':focus-visible')")
    wait_for_tokens(page, 10)
    page.keyboard.press("Enter")
    wait_for_state(page, "stopped")
    page.wait_for_function("() => document.activeElement.id === 'generate'", timeout=10_000)
    assert int(page.text_content("#tokens")) < 1000


def test_at_900px_and_less_the_focus_comes_back_to_generate_when_a_run_ends(server, browser):
    page = new_page(
        browser, viewport={"width": 900, "height": 800}
    )  # the run bar hides Generate while it runs
    try:
        open_playground(page, server.url)
        page.fill("#prompt", "def short():\n")
        page.fill("#max-tokens", "40")
        page.focus("#generate")
        page.keyboard.press("Enter")
        wait_for_state(page, "done")
        page.wait_for_function("() => document.activeElement.id === 'generate'", timeout=5_000)
        page.keyboard.press("Enter")  # and Enter runs again
        page.wait_for_function(
            "() => document.getElementById('state').dataset.state !== 'done'", timeout=5_000
        )
        wait_for_state(page, "done")
    finally:
        page.context.close()


def record_announcements(page) -> None:
    """From now on, window.announced lists each change of a live region's text: what a screen reader says."""
    page.evaluate("""() => {
        window.announced = [];
        for (const region of document.querySelectorAll("[aria-live], [role=status], [role=alert], [role=log]")) {
            new MutationObserver(() => window.announced.push(region.textContent.trim()))
                .observe(region, {subtree: true, childList: true, characterData: true});
        }
    }""")


def test_screen_readers_hear_the_run_and_its_refusals_not_every_worker_getting_busy(server, page):
    open_playground(page, server.url)
    record_announcements(page)
    busy = "() => document.getElementById('worker-status').textContent.includes('busy')"
    generate(page, numbered_lines(100), 1000)
    page.wait_for_function(busy, timeout=10_000)  # the pill shows the worker busy...
    wait_for_state(page, "done")
    page.wait_for_function(f"() => !({busy})()", timeout=10_000)  # ...and free again
    generate(page, "   ", 5)  # refused: a prompt of blanks
    wait_for_state(page, "error")

    heard = page.evaluate("window.announced")
    assert any(text.startswith("Streaming") for text in heard), heard
    assert any(text.startswith("Done") for text in heard), heard
    assert heard[-1].startswith("Error") and "prompt" in heard[-1], heard
    assert not [text for text in heard if "busy" in text], heard  # anyone's run flips it
    assert len(heard) < 12, heard  # a few words a run, not one per token or per poll


# ---- 10. stopping, honestly -----------------------------------------------------------------------


@contextlib.contextmanager
def second_in_the_queue(server, browser, first_lines: int, first_tokens: int):
    """Two playgrounds: the first's run holds the only worker (first_tokens at 400 tokens/s), the second's
    waits behind it once started; both pages close at the end."""
    first, second = new_page(browser), new_page(browser)
    try:
        open_playground(first, server.url)
        open_playground(second, server.url)
        generate(first, numbered_lines(first_lines), first_tokens)
        wait_for_tokens(first, 10)
        yield first, second
    finally:
        first.context.close()
        second.context.close()


def test_stopping_a_queued_run_says_it_never_started(server, browser):
    with second_in_the_queue(server, browser, 100, 3000) as (first, second):  # the first holds it 7.5 s
        generate(second, "def waiting():\n", 15)
        wait_for_state(second, "queued")
        second.click("#stop")
        wait_for_state(second, "cancelled")
        assert "before it started" in second.text_content("#state")
        assert "partial output" not in second.text_content("#state")
        assert second.text_content("#output") == "" and second.is_hidden("#copy")
        first.click("#stop")
        wait_for_state(first, "stopped")
        assert "partial output kept" in first.text_content("#state")


def seconds(shown: str) -> float:
    """ "7.13 s" or "17.0 ms", as the final stats show a time -> seconds."""
    value, unit = shown.split()
    return float(value) / (1000 if unit == "ms" else 1)


def test_the_final_stats_show_the_wait_in_the_queue(server, browser):
    with second_in_the_queue(server, browser, 80, 800) as (first, second):  # the first holds it 2 s
        generate(second, "def queued():\n", 14)
        wait_for_state(second, "done")
        # the first token's time is the worker's, from when it took the job: the wait before it is apart
        assert seconds(second.text_content("#stat-queue")) > 1.0, second.text_content("#final-stats")
        assert seconds(second.text_content("#stat-ttft")) < 1.0
        wait_for_state(first, "done")
        assert first.is_visible("#stat-queue")  # a run that did not wait says so too (a few ms)


def slow_server_frames(page, delay_ms: int) -> None:
    """Every frame from the server reaches the page `delay_ms` late, in order (a slow phone network)."""
    page.add_init_script(
        f"const delay = {delay_ms};"
        """
        const Native = window.WebSocket;
        window.WebSocket = class extends Native {
            constructor(url, protocols) {
                super(url, protocols);
                this.addEventListener("message", (event) => {
                    if (event.late) return;
                    event.stopImmediatePropagation();
                    setTimeout(() => {
                        const late = new MessageEvent("message", { data: event.data });
                        late.late = true;
                        this.dispatchEvent(late);
                    }, delay);
                });
            }
        };"""
    )


def test_stop_pressed_before_the_job_has_an_id_stops_it(server, page):
    slow_server_frames(page, 400)  # the job's id comes back ~0.4 s after Generate
    open_playground(page, server.url)
    prompt = numbered_lines(100)

    def stopped_early(start, stop) -> None:
        start()
        assert page.get_attribute("#state", "data-state") == "sending"
        assert page.is_enabled("#stop")
        stop()
        assert page.get_attribute("#state", "data-state") == "stopping"
        page.wait_for_selector("#state[data-state=stopped], #state[data-state=cancelled]", timeout=15_000)
        assert int(page.text_content("#tokens")) < 600  # 1.5 s of tokens, had the stop been lost

    page.fill("#prompt", prompt)
    page.fill("#max-tokens", "600")
    page.focus("#prompt")
    # the page's first run (no job before it), by the keys; then after a stopped run, by the buttons
    stopped_early(lambda: page.keyboard.press("Control+Enter"), lambda: page.keyboard.press("Escape"))
    stopped_early(lambda: page.click("#generate"), lambda: page.click("#stop"))
    stopped_early(lambda: page.click("#generate"), lambda: page.click("#stop"))
    assert page.errors == []


def long_run_through_a_proxy(server, page) -> tuple[Proxy, str]:
    """A run echoing a 300-line prompt, 50 tokens in, its websocket behind the test's Proxy."""
    proxy = Proxy(page)
    open_playground(page, server.url)
    prompt = numbered_lines(300)
    generate(page, prompt, len(prompt))
    wait_for_tokens(page, 50)
    return proxy, prompt


def test_stop_while_disconnected_waits_for_the_reconnect_without_flip_flopping(server, page):
    proxy, prompt = long_run_through_a_proxy(server, page)
    proxy.cut(keep_down=True)
    wait_for_state(page, "reconnecting")
    record_states(page)
    page.click("#stop")
    assert page.get_attribute("#state", "data-state") == "stopping"
    assert "once reconnected" in page.text_content("#state")
    proxy.wait_for_attempts(page, 4)  # a few failed tries: it keeps saying what will happen
    assert page.get_attribute("#state", "data-state") == "stopping"

    proxy.outage = False
    wait_for_state(page, "stopped")
    assert set(page.evaluate("window.seenStates")) <= {"stopping", "stopped"}
    shown = page.text_content("#output")
    assert 50 < len(shown) < len(prompt) and prompt.startswith(shown)
    assert page.get_attribute("#output", "data-stream-check") == "ok"


def test_a_run_that_fails_midway_keeps_its_partial_output_to_copy(server, page):
    proxy, prompt = long_run_through_a_proxy(server, page)
    job_id = page.evaluate("JSON.parse(sessionStorage.getItem('kog-playground')).job.id")
    # how a run whose worker dies ends: an error entry on its stream (sent here by the test, the stream's
    # last entry); the stand-in's later frames come before it and are dropped
    error = {"type": "error", "job_id": job_id, "id": "99999999999999-0", "code": "worker_lost"}
    proxy.sockets[-1].send(json.dumps({**error, "message": "The job's worker stopped; please try again."}))
    wait_for_state(page, "error")
    assert "worker stopped" in page.text_content("#state")
    shown = page.text_content("#output")
    assert shown and prompt.startswith(shown)

    page.click("#copy")
    page.wait_for_selector("#copy:text('Copied')")
    assert clipboard(page) == page.text_content("#output-context") + shown


# ---- 12. the share page, its 404, and long prompts ------------------------------------------------------


def test_the_share_page_shows_the_settings_copies_and_prefills_the_playground(server, page):
    open_playground(page, server.url)
    page.click("#system-details summary")
    page.fill("#system-prompt", '# "quoted" & <tagged>')
    prompt = "\ndef echo(x):\n    return x  # </textarea><script>alert(1)</script>\n"
    page.fill("#temperature", "0.55")
    page.fill("#top-p", "0.9")
    generate(page, prompt, 40)
    wait_for_state(page, "done")
    page.goto(server.url + page.get_attribute("#share", "href"))

    params = page.text_content("#params")
    for text in ("Temperature", "0.55", "Top-p", "0.9", "Max tokens", "40"):
        assert text in params, params
    model_text = '# "quoted" & <tagged>\n\n' + prompt  # what the completion model read
    page.click("#copy")
    page.wait_for_selector("#copy:text('Copied')")
    assert clipboard(page) == model_text + (model_text * 2)[:40]

    page.click("#try-it")
    page.wait_for_selector("#worker-status[data-up=true]", timeout=15_000)
    assert page.url.rstrip("/") == server.url  # the ?from= is dropped: a reload keeps later edits
    assert page.input_value("#prompt") == model_text
    assert page.input_value("#temperature") == "0.55" and page.input_value("#top-p") == "0.9"
    assert page.input_value("#max-tokens") == "40"
    assert page.input_value("#model") == MODEL
    assert page.locator("script:not([src])").count() == 0
    assert page.errors == []


def test_on_a_phone_the_share_page_gives_the_code_the_width_and_says_why_it_ended(server, page, browser):
    open_playground(page, server.url)
    generate(page, "def shared_on_a_phone():\n", 12)
    wait_for_state(page, "done")
    phone = new_page(browser, **PHONE_3X)
    try:
        phone.goto(server.url + page.get_attribute("#share", "href"))
        box = phone.locator("#output-box").bounding_box()
        assert box["width"] >= 0.85 * PHONE_3X["viewport"]["width"], box  # 42px margins a side left 78%
        assert phone.evaluate("document.documentElement.scrollWidth") <= PHONE_3X["viewport"]["width"]
        assert "reached max tokens" in phone.text_content(".share-head")  # the playground's words
        assert phone.errors == []
    finally:
        phone.context.close()


def test_an_unknown_share_id_gets_the_sites_own_404_page(server, page):
    response = page.goto(server.url + "/g/no-such-id")
    assert response.status == 404
    assert page.title() == "Not found · Kog playground"
    assert page.is_visible(".brand") and "no-such-id" in page.text_content("main")
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(10, 12, 16)"  # the site's stylesheet, not Django's bare page
    page.click("main a[href='/']")
    page.wait_for_selector("#prompt")


def paste_prompt(page, text: str) -> None:
    """Sets the prompt at once, as a paste does (typing 70,000 characters takes playwright minutes)."""
    page.eval_on_selector(
        "#prompt",
        "(el, text) => { el.value = text; el.dispatchEvent(new Event('input', {bubbles: true})); }",
        text,
    )


def test_a_prompt_over_64_kib_runs_and_one_over_the_limit_is_refused_on_the_page(server, page):
    open_playground(page, server.url)
    long_prompt = numbered_lines(7000)  # 70,000 characters
    paste_prompt(page, long_prompt)
    page.fill("#max-tokens", "30")
    page.click("#generate")
    wait_for_state(page, "done", timeout=30_000)
    assert page.text_content("#output") == long_prompt[:30]

    paste_prompt(page, "x" * 100_001)
    page.click("#generate")
    wait_for_state(page, "error")
    assert "100,001 characters; the limit is 100,000" in page.text_content("#state")
    assert "invalid" in page.get_attribute("#prompt", "class")
    assert page.text_content("#output") == long_prompt[:30]  # nothing was sent


# ---- 13. a completion goes on along its prompt's line; runs are saved, and the page says so --------------

LINE_TOPS = """() => {
    const last = [...document.getElementById('output-context').getClientRects()].at(-1);
    const first = document.getElementById('output').getClientRects()[0];
    return [last.top, first.top];
}"""


def test_a_completion_continues_the_line_its_prompt_ends_on_here_and_on_the_share_page(server, page):
    open_playground(page, server.url)
    for prompt in ("total = add(1, 2", "\nx = (1"):  # the second answer (its echo) opens with a newline
        generate(page, prompt, len(prompt))
        wait_for_state(page, "done")
        share = page.get_attribute("#share", "href")
        for shown in (page, None):
            if shown is None:
                page.goto(server.url + share)
                page.wait_for_selector("#output-context:not(:empty)")
            assert page.text_content("#output") == prompt
            # as laid out: the dimmed prompt and the answer with no line break between them (one, not two,
            # when the answer opens with its own)
            assert page.evaluate("document.getElementById('output-box').innerText") == prompt + prompt
            if not prompt.startswith("\n"):
                tops = page.evaluate(LINE_TOPS)
                assert tops[0] == tops[1], tops  # the answer starts on the prompt's last line
        open_playground(page, server.url)
    assert page.errors == []


def test_the_page_says_beside_generate_that_runs_are_saved_and_open_to_anyone_with_the_link(server, page):
    open_playground(page, server.url)
    note = page.locator("#saved-note")
    assert note.is_visible()
    assert note.text_content() == "Runs are saved for 30 days: anyone with a run's share link can open it."
    actions, said = page.locator("#actions").bounding_box(), note.bounding_box()
    assert 0 <= said["y"] - (actions["y"] + actions["height"]) < 40  # right under Generate and Stop


# ---- the model's recommended sampling -----------------------------------------------------------------


def sampling_fields(page) -> tuple[str, str, str]:
    return tuple(page.input_value(f"#{field}") for field in ("temperature", "top-p", "max-tokens"))


def test_a_base_model_invites_code_and_a_chat_model_a_request(server, advised_model, page):
    open_playground(page, server.url, model=MODEL)  # the stand-in has no chat template: it continues text
    placeholder = page.get_attribute("#prompt", "placeholder")
    assert placeholder.startswith('def merge_sorted(a, b):\n    """Merge two sorted lists')
    assert page.is_visible("#base-hint")
    assert page.text_content("#base-hint").startswith("This model continues code: start a function")
    page.select_option("#model", advised_model)  # ChatML: a chat model, which answers requests
    page.wait_for_function("() => document.getElementById('base-hint').hidden")
    assert (
        page.get_attribute("#prompt", "placeholder")
        == "Write a Python function that merges two sorted lists."
    )
    page.select_option("#model", MODEL)
    assert page.get_attribute("#prompt", "placeholder") == placeholder and page.is_visible("#base-hint")


def test_the_sampling_fields_follow_the_models_advice_until_the_person_sets_them(server, advised_model, page):
    open_playground(page, server.url, model=advised_model)
    page.wait_for_function("() => document.getElementById('temperature').value === '0.6'")
    assert sampling_fields(page) == ("0.6", "0.9", "40")
    assert page.is_visible("#sampling-hint")
    hint = page.text_content("#sampling-hint")
    assert hint.startswith(f"Temperature 0.6, top-p 0.9, max tokens 40: what {advised_model} recommends")
    page.select_option("#model", MODEL)  # a model that recommends nothing: the page's own
    assert sampling_fields(page) == ("0.2", "0.95", "512") and page.is_hidden("#sampling-hint")

    page.select_option("#model", advised_model)
    page.fill("#temperature", "1.1")  # the person's: it stays, whatever the model
    # and the hint stops calling it the model's at once, not at the next word from the workers
    assert page.text_content("#sampling-hint").startswith(f"Top-p 0.9, max tokens 40: what {advised_model}")
    page.select_option("#model", MODEL)
    assert sampling_fields(page) == ("1.1", "0.95", "512")
    page.select_option("#model", advised_model)
    assert sampling_fields(page) == ("1.1", "0.9", "40")
    assert page.text_content("#sampling-hint").startswith(f"Top-p 0.9, max tokens 40: what {advised_model}")
    page.reload()  # what the person set survives a reload; the rest follows the model again
    page.wait_for_selector("#worker-status[data-up=true]", timeout=15_000)
    page.wait_for_function("() => document.getElementById('top-p').value === '0.9'")
    assert sampling_fields(page) == ("1.1", "0.9", "40")

    # the run takes what the fields show: its share page says so
    page.fill("#prompt", "def f(")
    page.click("#generate")
    wait_for_state(page, "done", timeout=60_000)
    page.goto(server.url + page.get_attribute("#share", "href"))
    shown = page.eval_on_selector_all(
        "#params dt",
        "dts => Object.fromEntries(dts.map((dt) => [dt.textContent, dt.nextElementSibling.textContent]))",
    )
    assert {key: shown.get(key) for key in ("Temperature", "Top-p", "Max tokens")} == {
        "Temperature": "1.1",
        "Top-p": "0.9",
        "Max tokens": "40",
    }


def test_speculation_counters_show_tokens_per_step_and_drafts_kept_live(server, copying_model, page):
    """A code edit copies its prompt: while it streams, the page shows more than one token per model step and
    the share of drafted tokens the model kept; the final figures agree with the run's stats."""
    from inference.bench.workload import WORKLOAD

    prompt = next(p for p in WORKLOAD if p.name == "docstrings").text
    open_playground(page, server.url, model=copying_model)
    page.fill("#temperature", "0")
    page.evaluate("""() => {
        window.seenCounters = [];
        const state = document.getElementById("state");
        for (const id of ["tok-step", "accepted"]) {
            const el = document.getElementById(id);
            new MutationObserver(() => window.seenCounters.push([id, el.textContent, state.dataset.state]))
                .observe(el, {childList: true, characterData: true, subtree: true});
        }
    }""")
    generate(page, prompt, 120)
    wait_for_state(page, "done", timeout=60_000)
    seen = page.evaluate("window.seenCounters")
    live = [(id, value) for id, value, state in seen if state == "streaming" and value != "–"]
    assert any(id == "tok-step" and float(value) > 1 for id, value in live), seen
    assert any(id == "accepted" and 0 < float(value) <= 100 for id, value in live), seen
    stats = page.evaluate("kogPage.state.run.stats")
    tokens = int(page.text_content("#tokens"))
    assert float(page.text_content("#tok-step")) == pytest.approx(
        (tokens - 1) / stats["decode_steps"], abs=0.006
    )
    assert float(page.text_content("#accepted")) == pytest.approx(
        100 * stats["draft_n_accepted"] / stats["draft_n"], abs=0.51
    )
