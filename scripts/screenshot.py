"""docs/screenshot.png: the page as `make run` serves it, after one generation with the default model.

    .venv/bin/python scripts/screenshot.py [--prompt TEXT] [--out docs/screenshot.png]

Starts `python -m playground.run` on a free port (its own Redis and a throwaway database), drives Debian's
chromium through playwright (never `playwright install`), types the prompt, generates, and saves the page.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.redis_server import free_port  # noqa: E402

PROMPT = "class Stack:\n    def __init__(self):\n"


def launch(port: int, scratch: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MODELS")}
    env |= {"DATABASE_URL": f"sqlite:///{scratch / 'db.sqlite3'}", "DJANGO_DEBUG": "1", "LOG_FORMAT": "plain"}
    launcher = subprocess.Popen([sys.executable, "-m", "playground.run", "--port", str(port)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
    for line in launcher.stdout:
        if "Playground: http://" in line:
            return launcher
    raise SystemExit(f"playground.run exited ({launcher.wait()}) before it served")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshot.png")
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        launcher = launch(port, Path(scratch))
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium")
                page = browser.new_page(viewport={"width": 1280, "height": 860})
                page.goto(f"http://127.0.0.1:{port}/")
                page.wait_for_selector("#worker-status[data-up=true]", timeout=60_000)
                page.fill("#prompt", args.prompt)
                page.fill("#max-tokens", str(args.max_tokens))
                page.click("#generate")
                page.wait_for_selector("#state[data-state=done]", timeout=120_000)
                page.wait_for_timeout(500)  # the last animation frame and the highlighting
                page.screenshot(path=str(args.out))
                browser.close()
        finally:
            os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C: playground.run stops what it started
            launcher.wait(timeout=60)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
