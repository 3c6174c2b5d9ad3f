"""Run the whole playground on one machine: `python -m playground.run` (what `make run` calls).

Migrates the database, starts a Redis server of its own when REDIS_URL is unset, one inference
worker (the default model, or --model / MODELS; on CUDA when there is a GPU) and daphne on
http://127.0.0.1:8000. Ctrl-C stops everything; so does any one of them dying, except a worker that exits
to be restarted (its stall watchdog's code), which is started again.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from inference.names import ModelNameError, served_names, split_entry
from inference.protocol import worker_key
from inference.redis_server import redacted_url, start_redis, url_problem
from inference.worker import STALL_EXIT_CODE

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


# Set by Ctrl-C or SIGTERM. A flag, not an exception raised wherever the signal lands: raised inside Popen, it
# would leave the child being started out of `processes` (never stopped); raised inside stop(), a second
# Ctrl-C would abandon the children still stopping.
stop_requested = threading.Event()


def request_stop(*_) -> None:
    stop_requested.set()


def running(processes: dict[str, subprocess.Popen]) -> bool:
    return not stop_requested.is_set() and all(p.poll() is None for p in processes.values())


def wait_for_worker(url: str, worker_id: str, processes: dict[str, subprocess.Popen]) -> bool:
    """True once the worker's first heartbeat is in (a loading worker beats too: the page then shows a Hub
    download's progress while its models load); False if anything died or a stop was asked for."""
    client = redis.Redis.from_url(url)
    while running(processes):
        if client.exists(worker_key(worker_id)):
            return True
        stop_requested.wait(0.2)
    return False


def wait_for_port(host: str, port: int, processes: dict[str, subprocess.Popen]) -> bool:
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    while running(processes):
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return True
        except OSError:
            stop_requested.wait(0.1)
    return False


def check_redis(url: str) -> None:
    """An operator's REDIS_URL that answers nothing ends the launch in one line, not a client's traceback."""
    try:
        redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5).ping()
    except ValueError as exc:  # no redis://, rediss:// or unix:// scheme, a port that is no number, ...
        raise SystemExit(
            f"REDIS_URL={redacted_url(url)} is not a Redis URL ({url_problem(url, exc)}); "
            "e.g. redis://127.0.0.1:6379/0"
        ) from None
    except redis.RedisError as exc:
        raise SystemExit(f"cannot reach Redis at REDIS_URL={redacted_url(url)}: {exc}") from None


def absolute_entries(entries: list[str]) -> list[str]:
    """MODELS / --model entries with each relative folder that exists made absolute against this process's
    directory: the worker and daphne run in the repository's (spawn), where `./my-ft` is another folder or none.
    Presets, stand-ins and names (`name=./my-ft` keeps its name) are left as they are."""
    absolute = []
    for entry in entries:
        name, source = split_entry(entry)
        if source and not os.path.isabs(source) and not source.startswith("~") and Path(source).exists():
            source = os.path.abspath(source)
        absolute.append(source if name is None else f"{name}={source}")
    return absolute


def local_secret_key() -> str:
    """The settings want a secret key with DEBUG off: one made on first run, kept private in var/."""
    path = ROOT / "var" / "secret_key"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(50))
    return path.read_text().strip()


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
    if args.model:  # the web offers (and /readyz probes) the models this worker serves, not the default
        args.model = absolute_entries(args.model)
    models = args.model or absolute_entries([m for m in env.get("MODELS", "").split(",") if m.strip()])
    if models:
        try:
            served_names(models)  # two models served under one name: said now, not after a load
        except ModelNameError as exc:
            raise SystemExit(str(exc)) from None
        env["MODELS"] = ",".join(models)
    if not env.get("REDIS_URL"):
        # its own session too, so that Ctrl-C stops it last, after the worker (see finally below)
        redis_process, env["REDIS_URL"] = start_redis(ROOT / "var" / "redis", start_new_session=True)
        print(f"started redis-server at {env['REDIS_URL']}")
    else:
        check_redis(env["REDIS_URL"])
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGTERM also when started in the background
        signal.signal(sig, request_stop)
    try:
        return serve(args, env, processes)
    finally:
        if stop_requested.is_set():
            print("\nstopping…", flush=True)
        stop(processes)
        if redis_process is not None:  # last: the worker retires its heartbeat on the way out
            stop({"redis": redis_process})


def serve(args: argparse.Namespace, env: dict, processes: dict[str, subprocess.Popen]) -> int:
    """Starts daphne and the worker into `processes` and watches them until a stop is asked for (0) or one of
    them dies (SystemExit); the caller stops them."""
    migrate = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env)
    if stop_requested.is_set():
        return 0
    if migrate.returncode:
        raise SystemExit(f"manage.py migrate failed with code {migrate.returncode}; see its output above")
    processes["daphne"] = spawn(["-m", "playground.serve", "-b", args.host, "-p", str(args.port)], env)
    worker_args = None
    if not args.no_worker:
        worker_id = f"local-{os.getpid()}"
        # REDIS_URL reaches the worker through its environment, not its argv, where `ps` would show a password
        worker_args = ["-m", "inference.worker", "--worker-id", worker_id]
        for model in args.model or []:
            worker_args += ["--model", model]
        processes["worker"] = spawn(worker_args, env)
        print("loading the model…")
        if not wait_for_worker(env["REDIS_URL"], worker_id, processes):
            if stop_requested.is_set():
                return 0
            raise SystemExit("the worker did not start; see its log above")
    if not wait_for_port(args.host, args.port, processes):
        if stop_requested.is_set():
            return 0
        raise SystemExit(f"daphne did not start on port {args.port}; see its log above")
    print(f"\n  Playground: http://{args.host}:{args.port}/   (Ctrl-C stops it)\n", flush=True)
    while not stop_requested.wait(0.5):
        for name, process in processes.items():
            if name == "worker" and process.poll() == STALL_EXIT_CODE:
                print("the worker exited to be restarted (a job stalled it); starting it again", flush=True)
                processes["worker"] = spawn(worker_args, env)
            elif process.poll() is not None:
                raise SystemExit(f"{name} exited with code {process.returncode}; stopping")
    return 0


if __name__ == "__main__":
    sys.exit(main())
