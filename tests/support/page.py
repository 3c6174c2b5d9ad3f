"""What the browser tests share: a stand-in worker with daphne in front of it, and the page's basic moves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tests.support import WebServer, WorkerProcess

STANDIN = "standin:400"  # echoes the prompt at 400 tokens/s: every output is known exactly


def standin_server(redis_url: str, tmp: Path) -> Iterator[WebServer]:
    """One stand-in worker and one daphne for a whole module (starting them is most of a test's cost)."""
    worker = WorkerProcess(redis_url, [STANDIN], tmp / "worker.log")
    web = None
    try:
        worker.wait_ready()
        web = WebServer(redis_url, tmp)
        yield web
    finally:
        if web is not None:
            web.stop()
        worker.stop()


def open_playground(page, url: str, model: str = STANDIN) -> None:
    page.goto(url)
    page.wait_for_selector("#worker-status[data-up=true]", timeout=15_000)
    page.wait_for_selector(f'#model option[value="{model}"]', state="attached")
    page.select_option("#model", model)  # other tests' workers may still be listed for a few seconds


def generate(page, prompt: str, max_tokens: int) -> None:
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", str(max_tokens))
    page.click("#generate")


def record_states(page) -> None:
    """From now on, window.seenStates lists every state the page's status line takes, in order."""
    page.evaluate("""() => {
        window.seenStates = [];
        const state = document.getElementById("state");
        new MutationObserver(() => window.seenStates.push(state.dataset.state))
            .observe(state, {attributes: true, attributeFilter: ["data-state"]});
    }""")


def record_state_texts(page) -> None:
    """From now on, window.stateTexts lists every text the status line shows, in order."""
    page.evaluate("""() => {
        window.stateTexts = [];
        const state = document.getElementById("state");
        new MutationObserver(() => window.stateTexts.push(state.textContent))
            .observe(state, {subtree: true, childList: true, characterData: true});
    }""")


# A right-to-left override in a line of code shows the characters after it in reverse order, so that
# code reads other than it runs ("Trojan Source", CVE-2021-42574).
TROJAN = 'role = "user\u202ePQR"  # check\n'
LEFT_EDGES = """([selector, chars]) => {
    const element = document.querySelector(selector);
    const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
    const left = {};
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        for (let i = 0; i < node.length; i++) {
            if (!chars.includes(node.data[i])) continue;
            const range = document.createRange();
            range.setStart(node, i);
            range.setEnd(node, i + 1);
            left[node.data[i]] = range.getBoundingClientRect().left;
        }
    }
    return Array.from(chars, (c) => left[c]);
}"""


def new_page(browser, **options):
    """A page in a context of its own (1280 x 860 unless told), allowed the clipboard, its script errors in
    page.errors."""
    options.setdefault("viewport", {"width": 1280, "height": 860})
    context = browser.new_context(permissions=["clipboard-read", "clipboard-write"], **options)
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    return page
