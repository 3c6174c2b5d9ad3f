"""Run the whole playground on one machine: `python -m playground.run` (what `make run` calls).

Migrates the database, starts a Redis server of its own when REDIS_URL is unset, one inference
worker (the default model, or --model / MODELS; on CUDA when there is a GPU) and daphne on
http://127.0.0.1:8000, then keeps them up until Ctrl-C: one that dies (a crash, a kill, its stall
watchdog's restart code) is started again after a backoff (playground.supervise), the restart logged and
counted in /metrics. A start that fails before the playground first serves ends the launch, and so does a
worker whose first start exits with a code a restart cannot mend (a setting it cannot use, a model it cannot load).
"""

from __future__ import annotations

import argparse
import errno
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

from common.names import ModelNameError, served_names, split_entry
from common.protocol import worker_key
from common.redis_server import free_port, redacted_url, start_redis, url_problem
from playground.supervise import Child, Supervisor

ROOT = Path(__file__).resolve().parent.parent
# The worker's exits that a restart cannot mend (inference/worker.py's usage and load codes; torch-free here).
WORKER_FINAL_CODES = frozenset({2, 78})


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


def check_port_free(host: str, port: int) -> None:
    """Another server on the port (an earlier `make run`) ends the launch in one line: daphne would fail to bind
    and be restarted forever, while the address showed the other server's page."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as twisted binds: TIME_WAIT is no owner
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise SystemExit(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
            raise SystemExit(
                f"cannot serve on {host}:{port}: {exc.strerror} (another playground still running?); stop it, "
                "or choose another port: --port N (make run RUN_ARGS='--port N')"
            ) from None


def machine_names() -> list[str]:
    """The names and addresses other machines reach this one by: its host name (no reverse lookup: it may hang),
    and the IPv4 address of the interface that leads out (no packet is sent)."""
    names = {socket.gethostname()}
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the route
            names.add(udp.getsockname()[0])
    except OSError:
        pass  # no route out: the host name still counts
    # a name with "_" is no host name a browser's request may carry (RFC 1034): Django refuses it whatever the list
    return sorted(name for name in names if name and name != "0.0.0.0" and "_" not in name)


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


def debug_requested(env: dict) -> bool:
    return env.get("DJANGO_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}  # as settings.env_bool


def loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost")


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
    if debug_requested(env) and not loopback(args.host):
        raise SystemExit(
            f"DJANGO_DEBUG is on: its error pages show the settings, so it serves on 127.0.0.1 only, not "
            f"--host {args.host}; unset DJANGO_DEBUG (make run) to serve others"
        )
    check_port_free(args.host, args.port)
    if not loopback(args.host) and not env.get("DJANGO_ALLOWED_HOSTS", "").strip():
        # other machines ask for this one by its own name or address (a domain name in front of it is the host's)
        own = [] if args.host in ("0.0.0.0", "::") else [f"[{args.host}]" if ":" in args.host else args.host]
        env["DJANGO_ALLOWED_HOSTS"] = ",".join(
            dict.fromkeys(["127.0.0.1", "localhost", *own, *machine_names()])
        )
    if not env.get("DJANGO_SECRET_KEY", "").strip():  # unset or empty: a fresh machine serves all the same
        env["DJANGO_SECRET_KEY"] = local_secret_key()
    if args.model:  # the web offers (and /readyz probes) the models this worker serves, not the default
        args.model = absolute_entries(args.model)
    models = args.model or absolute_entries([m for m in env.get("MODELS", "").split(",") if m.strip()])
    if models:
        try:
            served_names(models)  # two models served under one name: said now, not after a load
        except ModelNameError as exc:
            raise SystemExit(str(exc)) from None
        env["MODELS"] = ",".join(models)
    supervisor = Supervisor()
    if not env.get("REDIS_URL"):
        port = free_port()
        env["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"

        def start_own_redis() -> subprocess.Popen:
            # its own session too, so that Ctrl-C stops it last, after the worker (see finally below); the
            # same port when it is restarted, where the worker and daphne look for it
            return start_redis(ROOT / "var" / "redis", port=port, start_new_session=True)[0]

        supervisor.launch(Child("redis", start_own_redis))
        print(f"started redis-server at {env['REDIS_URL']}")
    else:
        check_redis(env["REDIS_URL"])
    supervisor.redis_url = env["REDIS_URL"]
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGTERM also when started in the background
        signal.signal(sig, request_stop)
    try:
        return serve(args, env, supervisor)
    finally:
        if stop_requested.is_set():
            print("\nstopping…", flush=True)
        stop(supervisor.processes("daphne", "worker"))
        stop(supervisor.processes("redis"))  # last: the worker retires its heartbeat on the way out


class WorkerStarts:
    """Starts the worker, under a new id each time: readers of a job the last one ran see its id's heartbeat
    gone (worker_lost), never a namesake's."""

    def __init__(self, args: argparse.Namespace, env: dict):
        self.env, self.starts, self.worker_id = env, 0, ""
        self.models = args.model or []

    def __call__(self) -> subprocess.Popen:
        self.starts += 1
        self.worker_id = f"local-{os.getpid()}-{self.starts}"
        # REDIS_URL reaches the worker through its environment, not its argv, where `ps` would show a password
        worker_args = ["-m", "inference.worker", "--worker-id", self.worker_id]
        for model in self.models:
            worker_args += ["--model", model]
        return spawn(worker_args, self.env)

    def retire(self) -> None:
        """A worker that died (SIGKILL, a crash) leaves its heartbeat for up to HEARTBEAT_TTL_S: dropped now,
        so that the clients of its job hear worker_lost at their next look instead of seconds later."""
        client = redis.Redis.from_url(self.env["REDIS_URL"], socket_connect_timeout=1, socket_timeout=1)
        client.delete(worker_key(self.worker_id))
        client.close()


def serve(args: argparse.Namespace, env: dict, supervisor: Supervisor) -> int:
    """Starts daphne and the worker under `supervisor` and keeps them (and its Redis) up until a stop is asked
    for (0). A start that fails before the playground first serves, or a worker's first start that exits for
    good (supervisor.ended), ends the launch (SystemExit); the caller stops what runs."""
    migrate = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env)
    if stop_requested.is_set():
        return 0
    if migrate.returncode == 2:  # a web setting it cannot use: its one line above names it
        raise SystemExit(2)
    if migrate.returncode:
        raise SystemExit(f"manage.py migrate failed with code {migrate.returncode}; see its output above")
    daphne_args = ["-m", "playground.serve", "-b", args.host, "-p", str(args.port)]
    supervisor.launch(Child("daphne", lambda: spawn(daphne_args, env)))
    if not args.no_worker:
        worker = WorkerStarts(args, env)
        supervisor.launch(Child("worker", worker, on_exit=worker.retire, final_codes=WORKER_FINAL_CODES))
        print("loading the model…")
        if not wait_for_worker(env["REDIS_URL"], worker.worker_id, supervisor.processes()):
            if stop_requested.is_set():
                return 0
            raise SystemExit("the worker did not start; see its log above")
    if not wait_for_port(args.host, args.port, supervisor.processes()):
        if stop_requested.is_set():
            return 0
        worker_exit = supervisor.processes().get("worker")
        if worker_exit is not None and worker_exit.poll() is not None:  # the worker ended it, not daphne
            raise SystemExit(f"the worker exited with code {worker_exit.returncode}; see its line above")
        raise SystemExit(f"daphne did not start on port {args.port}; see its log above")
    print(f"\n  Playground: http://{args.host}:{args.port}/   (Ctrl-C stops it)", flush=True)
    if not loopback(args.host):
        print(
            f"  It answers to: {env['DJANGO_ALLOWED_HOSTS'].replace(',', ', ')} (DJANGO_ALLOWED_HOSTS)",
            flush=True,
        )
    print(flush=True)
    supervisor.publish_counts()
    while not stop_requested.wait(0.5):
        supervisor.check()
        if supervisor.ended:
            raise SystemExit(supervisor.ended)
    return 0


if __name__ == "__main__":
    sys.exit(main())
