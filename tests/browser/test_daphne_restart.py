"""A host's playground under `make run`'s launcher: when daphne dies and the launcher starts it again, a page
that was open reconnects on its own (no reload) and serves the next prompt."""

from __future__ import annotations

import os
import signal

import pytest

from tests.support.launcher import Output, child_named, ctrl_c, launched
from tests.support.page import STANDIN, generate, open_playground

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]


def test_an_open_page_reconnects_after_daphne_restarts_and_serves_the_next_prompt(tmp_path, page):
    with launched(tmp_path, "--model", STANDIN) as (launcher, port):
        output = Output(launcher)
        output.wait_for("Playground: http://", timeout_s=120)
        open_playground(page, f"http://127.0.0.1:{port}")
        generate(page, "before\n", 7)
        page.wait_for_selector("#state[data-state=done]", timeout=20_000)
        assert page.text_content("#output") == "before\n"

        daphne = child_named(launcher, b"playground.serve")
        os.kill(daphne, signal.SIGKILL)
        page.wait_for_selector("#app[data-connected=false]", timeout=10_000)  # the page saw the drop
        page.wait_for_selector("#app[data-connected=true]", timeout=30_000)  # and came back by itself
        assert child_named(launcher, b"playground.serve") not in (None, daphne)
        page.wait_for_selector("#worker-status[data-up=true]", timeout=15_000)

        generate(page, "after the restart\n", 18)
        page.wait_for_selector("#state[data-state=done]", timeout=20_000)
        assert page.text_content("#output") == "after the restart\n"
        assert "daphne exited with code -9; starting it again" in output.text()
        rest = ctrl_c(launcher)
    assert launcher.returncode == 0, output.text() + rest
