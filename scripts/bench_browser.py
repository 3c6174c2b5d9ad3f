"""Benchmark (not a test): does the page keep up with a 5,000 tokens/s stream?

    .venv/bin/python scripts/bench_browser.py [--rate 5000] [--tokens 25000]

Starts its own Redis, a worker running the stand-in engine at --rate tokens/s (it echoes the
prompt, so the expected text is known), daphne, and Debian's chromium. It generates --tokens
tokens and reports:
  * delivery: the page shows every token, exactly once, in order;
  * speed: the live tokens/s the page displays while streaming vs. the engine's own figure;
  * smoothness: counter updates per second, animation frames per second, the longest frame gap.
Exits 1 when a token is missing or the displayed speed is more than 3% off the engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.redis_server import free_port, start_redis  # noqa: E402
from tests.support import CHROMIUM, CHROMIUM_ARGS  # noqa: E402  (the flags the browser tests use)

CODE = '''def merge(left: list[int], right: list[int]) -> list[int]:
    """Merge two sorted lists."""
    out, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i]); i += 1
        else:
            out.append(right[j]); j += 1
    return out + left[i:] + right[j:]

'''

# Runs in the page before its own scripts: samples what a person would see, from the browser's side.
PROBE = """
window.bench = {samples: [], frames: [], longTasks: 0, states: [], tokenUpdates: []};
new PerformanceObserver((list) => { window.bench.longTasks += list.getEntries().length; })
  .observe({type: "longtask", buffered: true});
(function tick(now) { window.bench.frames.push(now); requestAnimationFrame(tick); })(performance.now());
document.addEventListener("DOMContentLoaded", () => {
  const render = window.kogHighlight.render;
  window.kogHighlight.render = (el, text) => {
    const t0 = performance.now(); render(el, text); el.offsetHeight;
    window.bench.highlightMs = performance.now() - t0;
  };
  const rate = document.getElementById("tok-s"), state = document.getElementById("state");
  const tokens = document.getElementById("tokens");
  new MutationObserver(() => window.bench.tokenUpdates.push(performance.now()))
    .observe(tokens, {childList: true, characterData: true, subtree: true});
  new MutationObserver(() => window.bench.samples.push([performance.now(), rate.textContent, state.dataset.state]))
    .observe(rate, {childList: true, characterData: true, subtree: true});
  new MutationObserver(() => window.bench.states.push([performance.now(), state.dataset.state]))
    .observe(state, {attributes: true, attributeFilter: ["data-state"]});
});
"""


def wait_http(url: str, process: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"daphne exited with {process.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("daphne did not start")


def run(args, page_url: str) -> dict:
    from playwright.sync_api import sync_playwright

    prompt = CODE
    expected = (prompt * (args.tokens // len(prompt) + 1))[: args.tokens]
    received: list[dict] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.add_init_script(PROBE)
        page.on(
            "websocket",
            lambda ws: ws.on(
                "framereceived", lambda f: received.append({**json.loads(f), "_at": time.monotonic()})
            ),
        )
        page.goto(page_url)
        page.wait_for_selector("#worker-status[data-up=true]", timeout=60_000)
        page.fill("#prompt", prompt)
        page.fill("#max-tokens", str(args.tokens))
        page.fill("#temperature", "0")
        page.click("#generate")
        page.wait_for_selector("#state[data-state=done]", timeout=(args.tokens / args.rate + 60) * 1000)
        shown = page.text_content("#output")
        check = page.get_attribute("#output", "data-stream-check")
        page.wait_for_timeout(1000)  # frames after the end: highlighting and the final stats
        bench = page.evaluate("window.bench")
        browser.close()

    deltas = [f for f in received if f.get("type") == "delta"]
    done = next(f for f in received if f.get("type") == "done")
    streaming = [(t, float(v)) for t, v, s in bench["samples"] if s == "streaming" and v not in ("–", "")]
    start = next(t for t, s in bench["states"] if s == "streaming")
    end = next(t for t, s in bench["states"] if s == "done")
    frames = [t for t in bench["frames"] if start <= t <= end]
    gaps = [b - a for a, b in zip(frames, frames[1:], strict=False)]
    return {
        "expected": expected,
        "shown": shown,
        "stream_check": check,
        "deltas": len(deltas),
        "last_n": deltas[-1]["n"] if deltas else 0,
        "stats": done["stats"],
        "live_rates": [v for _, v in streaming],
        "stream_s": (end - start) / 1000,
        "deltas_s": deltas[-1]["_at"] - deltas[0]["_at"] if deltas else 0.0,
        "done_lag_s": done["_at"] - deltas[-1]["_at"] if deltas else 0.0,
        "counter_updates": len([t for t in bench["tokenUpdates"] if start <= t <= end]),
        "fps": len(frames) / ((end - start) / 1000) if end > start else 0.0,
        "max_frame_gap_ms": max(gaps, default=0.0),
        "long_tasks": bench["longTasks"],
        "highlight_ms": bench.get("highlightMs", 0.0),
        "finish_gap_ms": max(
            (b - a for a, b in zip(bench["frames"], bench["frames"][1:], strict=False) if b >= end),
            default=0.0,
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=5000, help="stand-in engine tokens/s")
    parser.add_argument("--tokens", type=int, default=25000)
    parser.add_argument("--chromium", default=CHROMIUM)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kog-bench-"))
    redis_process, redis_url = start_redis(tmp / "redis")
    port = free_port()
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}",
        "DJANGO_SECRET_KEY": "bench-only",
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1",
        "PLAYGROUND_MAX_NEW_TOKENS": str(max(args.tokens, 8192)),
        "PYTHONUNBUFFERED": "1",
    }
    log = open(tmp / "processes.log", "wb")  # noqa: SIM115 - closed below
    processes = []
    try:
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env, check=True,
                       stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        model = f"standin:{args.rate:g}"
        for command in (
            ["-m", "inference.worker", "--redis-url", redis_url, "--model", model],
            ["-m", "playground.serve", "-b", "127.0.0.1", "-p", str(port)],
        ):
            processes.append(subprocess.Popen([sys.executable, *command], cwd=ROOT, env=env, stdout=log,
                                              stderr=subprocess.STDOUT))  # fmt: skip
        url = f"http://127.0.0.1:{port}/"
        wait_http(url, processes[-1])
        result = run(args, url)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=15)
        redis_process.terminate()
        log.close()

    stats = result["stats"]
    engine_rate = stats["decode_tok_s"]
    live = result["live_rates"]
    # the speed shown at the end of the stream, before the final stats replace it
    shown_rate = live[-1] if live else 0.0
    error = abs(shown_rate - engine_rate) / engine_rate if engine_rate else 1.0
    complete = result["shown"] == result["expected"] and result["last_n"] == args.tokens
    print(
        f"stand-in engine          {args.rate:,.0f} tokens/s nominal, {engine_rate:,.1f} tokens/s measured by the engine"
    )
    print(f"tokens                   {args.tokens:,} generated, {result['last_n']:,} counted by the page, "
          f"text {'identical' if result['shown'] == result['expected'] else 'DIFFERENT'} "
          f"(stream check: {result['stream_check']})")  # fmt: skip
    print(
        f"websocket frames         {result['deltas']:,} deltas ({args.tokens / max(result['deltas'], 1):.0f} tokens each)"
    )
    print(f"arrival                  deltas over {result['deltas_s']:.2f} s (engine: "
          f"{(stats['token_times'][-1] - stats['token_times'][0]) if stats.get('token_times') else stats['total_ms'] / 1000:.2f} s), "
          f"done frame {1000 * result['done_lag_s']:.0f} ms after the last delta")  # fmt: skip
    print(f"displayed speed          {shown_rate:,.1f} tokens/s at the end of the stream "
          f"({100 * error:.2f}% from the engine's); median while streaming {statistics.median(live) if live else 0:,.1f}")  # fmt: skip
    print(f"counter updates          #tokens changed {result['counter_updates'] / result['stream_s']:.1f} times "
          f"per second over {result['stream_s']:.2f} s of streaming")  # fmt: skip
    print(f"page                     {result['fps']:.1f} frames/s, longest frame gap {result['max_frame_gap_ms']:.0f} ms, "
          f"{result['long_tasks']} long tasks (> 50 ms) in all; "
          f"{result['finish_gap_ms']:.0f} ms frame at the end ({result['highlight_ms']:.0f} ms of it highlighting)")  # fmt: skip
    ok = complete and error <= 0.03
    print("PASS" if ok else "FAIL", "(every token shown; displayed speed within 3% of the engine's)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
