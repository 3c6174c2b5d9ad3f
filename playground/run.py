"""Run the whole playground on one machine: `python -m playground.run` (what `make run` calls).

Migrates the database, starts a Redis server of its own when REDIS_URL is unset, one inference
worker (the default model, or --model / MODELS; on CUDA when there is a GPU) and daphne on
http://127.0.0.1:8000. Ctrl-C stops everything; so does any one of them dying.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

from inference.protocol import worker_key
from inference.redis_server import start_redis

ROOT = Path(__file__).resolve().parent.parent


def spawn(args: list[str], env: dict) -> subprocess.Popen:
    # Own session: Ctrl-C reaches only this launcher, which then stops the children in order.
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, start_new_session=True)


def stop(processes: dict[str, subprocess.Popen]) -> None:
    for process in processes.values():
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + 15
    for name, process in processes.items():
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"{name} did not stop in time; killing it", file=sys.stderr)
            process.kill()
            process.wait()


def wait_for_worker(url: str, worker_id: str, processes: dict[str, subprocess.Popen]) -> bool:
    """True once the worker's first heartbeat is in (its models are loaded); False if anything died."""
    client = redis.Redis.from_url(url)
    while all(p.poll() is None for p in processes.values()):
        if client.exists(worker_key(worker_id)):
            return True
        time.sleep(0.2)
    return False


def wait_for_port(host: str, port: int, processes: dict[str, subprocess.Popen]) -> bool:
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    while all(p.poll() is None for p in processes.values()):
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def local_secret_key() -> str:
    """The settings want a secret key with DEBUG off: one made on first run, kept private in var/."""
    path = ROOT / "var" / "secret_key"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(50))
    return path.read_text().strip()


def interrupt(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m playground.run", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--model", action="append", help="checkpoint dir or preset for the worker (repeatable)"
    )
    parser.add_argument("--no-worker", action="store_true", help="web only (workers run elsewhere)")
    args = parser.parse_args(argv)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("DJANGO_SECRET_KEY", local_secret_key())
    processes: dict[str, subprocess.Popen] = {}
    redis_process = None
    if not env.get("REDIS_URL"):
        # its own session too, so that Ctrl-C stops it last, after the worker (see finally below)
        redis_process, env["REDIS_URL"] = start_redis(ROOT / "var" / "redis", start_new_session=True)
        print(f"started redis-server at {env['REDIS_URL']}")
    for sig in (
        signal.SIGINT,
        signal.SIGTERM,
    ):  # also when started in the background, where SIGINT is ignored
        signal.signal(sig, interrupt)
    try:
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env, check=True)
        processes["daphne"] = spawn(["-m", "playground.serve", "-b", args.host, "-p", str(args.port)], env)
        if not args.no_worker:
            worker_id = f"local-{os.getpid()}"
            worker_args = ["-m", "inference.worker", "--redis-url", env["REDIS_URL"]]
            worker_args += ["--worker-id", worker_id]
            for model in args.model or []:
                worker_args += ["--model", model]
            processes["worker"] = spawn(worker_args, env)
            print("loading the model…")
            if not wait_for_worker(env["REDIS_URL"], worker_id, processes):
                raise SystemExit("the worker did not start; see its log above")
        if not wait_for_port(args.host, args.port, processes):
            raise SystemExit(f"daphne did not start on port {args.port}; see its log above")
        print(f"\n  Playground: http://{args.host}:{args.port}/   (Ctrl-C stops it)\n", flush=True)
        while True:
            for name, process in processes.items():
                if process.poll() is not None:
                    raise SystemExit(f"{name} exited with code {process.returncode}; stopping")
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nstopping…")
        return 0
    finally:
        stop(processes)
        if redis_process is not None:  # last: the worker retires its heartbeat on the way out
            stop({"redis": redis_process})


if __name__ == "__main__":
    sys.exit(main())
