"""The inference worker: loads its models once, takes jobs from Redis, streams tokens back.

    python -m inference.worker [--model DIR_OR_PRESET ...] [--redis-url URL] [--device cpu|cuda]

Models come from --model, else $MODELS (comma-separated), else the shipped default model; a model
named `standin:<tokens/s>` is the torch-free stand-in engine (inference/standin.py). Any number of
workers, on any machines, may serve the same queues: each job goes to exactly one.
With $KOG_HEALTH_FILE set, each heartbeat also touches that file (a container healthcheck reads it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import redis

from inference.events import Done, InvalidRequest, Prefilled, TextDelta
from inference.protocol import HEARTBEAT_INTERVAL_S, JobSpec, WorkerChannel
from inference.standin import PREFIX as STANDIN_PREFIX
from inference.standin import StandinEngine

log = logging.getLogger("inference.worker")

FLUSH_INTERVAL_S = float(os.environ.get("KOG_FLUSH_MS", "25")) / 1000  # coalescing: 16-50 ms per frame


class DeltaCoalescer:
    """Sends the first token at once, then at most one delta entry per FLUSH_INTERVAL_S.

    Each delta carries the worker-side clock: `t` (last token), `t_first` (first token) and `n`
    (tokens so far), so a client computes decode tokens/s = (n - 1) / (t - t_first) from any entry.
    """

    def __init__(self, publish, flush_interval_s: float = FLUSH_INTERVAL_S):
        self.publish = publish
        self.flush_interval_s = flush_interval_s
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.n = 0
        self.t_first: float | None = None
        self.t_last = 0.0
        self.last_flush = 0.0

    def add(self, delta: TextDelta) -> bool:
        """Buffer a delta; returns True when it flushed (the moment to look for a cancel)."""
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.n += len(delta.token_ids)
        self.t_last = delta.t
        if self.t_first is None:
            self.t_first = delta.t
        now = time.monotonic()
        if self.n == len(self.token_ids) or now - self.last_flush >= self.flush_interval_s:
            self.flush(now)
            return True
        return False

    def flush(self, now: float | None = None) -> None:
        if not self.token_ids:
            return
        self.publish(
            "delta",
            {
                "text": "".join(self.text),
                "token_ids": self.token_ids,
                "n": self.n,
                "t": self.t_last,
                "t_first": self.t_first,
            },
        )
        self.text, self.token_ids = [], []
        self.last_flush = now or time.monotonic()


class Worker:
    def __init__(self, engines: dict, r: redis.Redis, worker_id: str | None = None):
        self.engines = engines  # public model name -> Engine
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.channel = WorkerChannel(r, self.worker_id, list(engines))
        self.current_job: str | None = None
        self.jobs_done = 0
        self.stopping = threading.Event()

    def info(self) -> dict:
        any_engine = next(iter(self.engines.values()))
        return {
            "device": str(any_engine.device),
            "job": self.current_job,
            "jobs_done": self.jobs_done,
            "peak_bandwidth_gbs": getattr(any_engine, "peak_bandwidth_gbs", None),
            # what a client needs to build a request: whether to send chat messages, how long a prompt fits
            "model_info": {
                name: {
                    "chat": bool(getattr(engine.tokenizer, "has_chat_template", False)),
                    "max_context": engine.max_context,
                }
                for name, engine in self.engines.items()
            },
        }

    def _heartbeat_loop(self) -> None:
        health_file = os.environ.get("KOG_HEALTH_FILE")
        while not self.stopping.is_set():
            try:
                self.channel.heartbeat(self.info())
                if health_file:
                    Path(health_file).touch()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            self.stopping.wait(HEARTBEAT_INTERVAL_S)

    def serve_forever(self) -> None:
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        log.info("worker %s serving %s", self.worker_id, ", ".join(self.engines))
        while not self.stopping.is_set():
            try:
                spec = self.channel.next_job(timeout_s=1.0)
            except redis.ConnectionError as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                time.sleep(1.0)
                continue
            if spec is not None:
                self.run_job(spec)
        self.channel.retire()

    def run_job(self, spec: JobSpec) -> None:
        self.current_job = spec.id
        try:
            self._run(spec)
        except InvalidRequest as exc:
            self.channel.finish(
                spec.id, "error", {"code": "invalid_request", "param": exc.field, "message": str(exc)}
            )
        except Exception as exc:  # the worker outlives any one job
            code = "out_of_memory" if "out of memory" in str(exc).lower() else "internal_error"
            log.exception("job %s failed", spec.id)
            self.channel.finish(spec.id, "error", {"code": code, "message": f"{type(exc).__name__}: {exc}"})
            _release_gpu_memory()
        finally:
            self.current_job = None
            self.jobs_done += 1

    def _run(self, spec: JobSpec) -> None:
        engine = self.engines.get(spec.model)
        if engine is None:
            raise InvalidRequest(
                "model", f"unknown model {spec.model!r}; this worker serves {list(self.engines)}"
            )
        params = spec.sampling_params()
        prompt_ids = engine.encode_prompt(prompt=spec.prompt, messages=spec.messages, chat=spec.chat)
        publish = lambda kind, data: self.channel.publish(spec.id, kind, data)  # noqa: E731
        coalescer = DeltaCoalescer(publish)
        cancelled = False

        def should_stop() -> bool:
            return cancelled

        for event in engine.generate(prompt_ids, params, should_stop=should_stop):
            if isinstance(event, TextDelta):
                if coalescer.add(event):
                    cancelled = cancelled or self.channel.cancelled(spec.id)
            elif isinstance(event, Prefilled):
                publish("prefilled", asdict(event))
                cancelled = self.channel.cancelled(spec.id)
            elif isinstance(event, Done):
                coalescer.flush()
                done = asdict(event)
                done["stats"]["bandwidth_gbs"] = event.stats.bandwidth_gbs
                self.channel.finish(spec.id, "done", done)
                return
        raise RuntimeError("the engine ended without a Done event")


def _release_gpu_memory() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort after a failure
        pass


def configured_models(cli_models: list[str] | None) -> list[str]:
    if cli_models:
        return cli_models
    from_env = [m.strip() for m in os.environ.get("MODELS", "").split(",") if m.strip()]
    if from_env:
        return from_env
    from inference.engine import DEFAULT_MODEL

    return [str(DEFAULT_MODEL)]


def load_engine(model: str, device: str | None, dtype: str | None):
    if model.startswith(STANDIN_PREFIX):
        return StandinEngine.load(model)
    from inference.engine import Engine  # torch loads here, not at import

    return Engine.load(model, device=device, dtype=dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m inference.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="checkpoint dir or synthetic preset (repeatable)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--device", default=os.environ.get("KOG_DEVICE"), choices=["cpu", "cuda", None])
    parser.add_argument("--dtype", default=os.environ.get("KOG_DTYPE"))
    parser.add_argument("--worker-id", default=os.environ.get("WORKER_ID"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")

    engines = {}
    for model in configured_models(args.model):
        engine = load_engine(model, device=args.device, dtype=args.dtype)
        engines[engine.name] = engine
        log.info("loaded %s on %s", engine.name, engine.device)
    worker = Worker(engines, redis.Redis.from_url(args.redis_url, decode_responses=True), args.worker_id)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stopping.set())
    worker.serve_forever()


if __name__ == "__main__":
    main()
