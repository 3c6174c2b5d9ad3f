"""What the browser tests share: a stand-in worker with daphne in front of it, and the page's basic moves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tests.conftest import WebServer, WorkerProcess

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
