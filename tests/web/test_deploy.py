"""Deployment files: docker-compose.yml against the Compose spec, and the healthchecks it runs."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from packaging.requirements import Requirement
from ruamel.yaml import YAML

from common.redis_server import free_port, redis_binary
from scripts.requirements import requirements
from tests.support import WebServer, WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CHECK_JSONSCHEMA = Path(sys.executable).with_name("check-jsonschema")
VOLUME = re.compile(r"(.+):(/[^:]*)(?::ro|:rw)?")  # a service's volume: source, container path, mode
# Compose's interpolation, the forms the file uses: ${VAR}, ${VAR:-default}, ${VAR:?error}
INTERPOLATION = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def interpolate(value, env: dict):
    """`value` (a string, or lists and maps of them) as `docker compose` reads it with `env` set; KeyError for a
    ${VAR:?error} whose VAR is unset or empty, as compose refuses to start then."""

    def one(match: re.Match) -> str:
        name, form, text = match.groups()
        if env.get(name):
            return env[name]
        if form == "?":
            raise KeyError(f"{name}: {text}")
        return text if form == "-" else ""

    if isinstance(value, str):
        return INTERPOLATION.sub(one, value)
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    return {key: interpolate(item, env) for key, item in value.items()}


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
    )


def dockerfile_stages() -> dict[str, tuple[str, str]]:
    """The Dockerfile's stages: {name: (the image or stage it builds FROM, its instructions without comments)}."""
    stages = {}
    text = (ROOT / "Dockerfile").read_text()
    for block in re.split(r"^(?=FROM )", text, flags=re.MULTILINE)[1:]:
        start = re.match(r"FROM (\S+) AS (\w+)", block)
        assert start, f"a stage without a name: {block.splitlines()[0]}"
        lines = [line for line in block.splitlines() if not line.lstrip().startswith("#")]
        stages[start[2]] = (start[1], "\n".join(lines))
    return stages


def stage_text(name: str) -> str:
    """A stage's instructions, after those of the stages it builds on."""
    stages = dockerfile_stages()
    parts = []
    while name in stages:
        name, text = stages[name]
        parts.insert(0, text)
    return "\n".join(parts)


def installed_closure(requirements: list[str]) -> set[str]:
    """The distributions `requirements` pull in, found through this environment's installed metadata (one not
    installed here counts by its name alone)."""
    seen: set[str] = set()
    todo = [Requirement(line).name for line in requirements]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            lines = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in lines:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def stage_requirements(name: str) -> list[str]:
    """What a stage installs through scripts/requirements.py, as that script reads pyproject.toml."""
    roles = re.findall(r"python scripts/requirements\.py ([\w ]+?) >", stage_text(name))
    assert roles, f"the {name} stage installs nothing from pyproject.toml"
    return requirements([role for line in roles for role in line.split()])


def test_the_web_image_installs_no_torch():
    """The web process never imports torch (test_no_torch.py); its image does not carry its gigabytes either."""
    heavy = {"torch", "triton"}
    web = stage_text("web")
    assert not heavy & set(re.findall(r"[\w-]+", web)), web
    assert not heavy & installed_closure(stage_requirements("web"))
    # the same checks find them in the worker's stage
    assert "torch" in re.findall(r"[\w-]+", stage_text("worker"))
    assert heavy <= installed_closure(stage_requirements("worker"))


def test_compose_file_follows_the_compose_spec(tmp_path):
    result = validate(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr
    # the check bites: a misspelt key in a service is refused
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("    healthcheck:\n", "    healthchek:\n", 1))
    assert validate(broken).returncode != 0


def test_compose_runs_redis_web_and_a_gpu_worker_from_the_dockerfiles_two_stages():
    services = YAML(typ="safe").load(COMPOSE.read_text())["services"]
    assert set(services) == {"redis", "web", "worker"}
    web, worker = services["web"], services["worker"]
    assert web["build"] == {"context": ".", "target": "web"} and worker["build"] == {
        "context": ".",
        "target": "worker",
    }
    assert web["image"] != worker["image"]
    assert {"web", "worker"} <= set(dockerfile_stages())
    assert "python -m playground.serve" in " ".join(
        web["command"]
    )  # daphne with the playground's frame limit
    assert worker["command"] == ["python", "-m", "inference.worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    assert any(volume.endswith(":/models:ro") for volume in worker["volumes"])  # read-only model folder
    assert "MODELS" in worker["environment"]
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] == "CMD", name
        if name != "redis":
            url = interpolate(service["environment"]["REDIS_URL"], {"REDIS_PASSWORD": "0123abcd"})
            assert url == "redis://:0123abcd@redis:6379/0"
            assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    for path in ("scripts/healthcheck.py", "manage.py"):  # what the commands run exists in the image
        assert (ROOT / path).is_file()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "var" in ignored
    # people's checkpoints in ./models stay out of the build context; the shipped default goes in
    assert ignored.index("models/*") < ignored.index("!models/default") and (ROOT / "models/default").is_dir()
    # a stopped worker finishes its job first: more than docker's default 10 s
    grace = re.fullmatch(r"(\d+)(s|m)", worker["stop_grace_period"])
    assert int(grace[1]) * (60 if grace[2] == "m" else 1) >= 60


def test_worker_keeps_its_compiled_kernels_in_a_named_volume_it_can_write():
    compose = YAML(typ="safe").load(COMPOSE.read_text())
    worker = compose["services"]["worker"]
    cache_dir = Path(worker["environment"]["TRITON_CACHE_DIR"])
    # "source:/container/path[:ro]" -> {container path: source}
    mounts = {Path(match[2]): match[1] for match in map(VOLUME.fullmatch, worker["volumes"])}
    mount_point = next(path for path in mounts if cache_dir.is_relative_to(path))
    assert mounts[mount_point] in compose["volumes"]  # a named volume, kept across restarts and rebuilds
    # The worker runs as kog: a fresh named volume takes the owner of the image's folder at its mount point.
    dockerfile = stage_text("worker")
    commands = [part.split() for part in re.split(r"&&|\\\n|\n", dockerfile)]
    commands = [words[1:] if words[:1] == ["RUN"] else words for words in commands]  # the shell's commands
    assert any(words[:2] == ["mkdir", "-p"] and str(mount_point) in words for words in commands)
    assert any(words[:2] == ["chown", "kog"] and str(mount_point) in words for words in commands)
    assert dockerfile.index("chown kog") < dockerfile.index("USER kog")


def healthcheck(role: str, env: dict) -> int:
    return subprocess.run(
        [sys.executable, "scripts/healthcheck.py", role], cwd=ROOT, env={**os.environ, **env}, timeout=30
    ).returncode


def test_web_healthcheck_passes_against_daphne_and_fails_without_it(start_web):
    # The check sends a Host header the deployment allows (here not 127.0.0.1's own name).
    server = start_web(env={"DJANGO_ALLOWED_HOSTS": "play.example.com,127.0.0.1"})
    env = {"PORT": str(server.port), "DJANGO_ALLOWED_HOSTS": "play.example.com"}
    assert healthcheck("web", env) == 0
    server.stop()
    assert healthcheck("web", env) == 1


def test_worker_healthcheck_follows_the_heartbeat_file(start_worker, tmp_path):
    env = {"KOG_HEALTH_FILE": str(tmp_path / "alive")}
    assert healthcheck("worker", env) == 1  # no heartbeat yet
    worker = start_worker(models=["standin:10"], env=env)
    assert healthcheck("worker", env) == 0
    worker.stop()
    os.utime(env["KOG_HEALTH_FILE"], (1, 1))  # its last heartbeat, long ago
    assert healthcheck("worker", env) == 1


def test_compose_keeps_redis_private_and_always_behind_its_password():
    services = YAML(typ="safe").load(COMPOSE.read_text())["services"]
    redis = services["redis"]
    assert "ports" not in redis  # published only by the operator's own choice (docs/hosting.md)
    # no password, no playground: compose refuses to start rather than run an open Redis
    for where in (redis["command"], redis["environment"], services["web"]["environment"]["REDIS_URL"],
                  services["worker"]["environment"]["REDIS_URL"]):  # fmt: skip
        with pytest.raises(KeyError, match="REDIS_PASSWORD"):
            interpolate(where, {"REDIS_PASSWORD": ""})


def start_compose_redis(data_dir: Path, password: str) -> tuple[subprocess.Popen, int]:
    """redis-server with the compose service's own arguments (its port on 127.0.0.1 here)."""
    command = interpolate(YAML(typ="safe").load(COMPOSE.read_text())["services"]["redis"]["command"],
                          {"REDIS_PASSWORD": password})  # fmt: skip
    assert command[0] == "redis-server"
    port = free_port()
    args = [redis_binary(), *command[1:], "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir)]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                assert s.recv(64).startswith(b"-NOAUTH")  # it answers, and only to whoever has the password
                return process, port
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("the compose redis did not answer")


def test_the_secrets_file_compose_reads_stays_out_of_git_and_the_image():
    """docs/hosting.md: DJANGO_SECRET_KEY and REDIS_PASSWORD go in ./.env, which docker compose reads by itself."""
    ignored = subprocess.run(["git", "check-ignore", "--quiet", ".env"], cwd=ROOT)
    assert ignored.returncode == 0, ".env is not in .gitignore"
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert ".env" in patterns, (
        ".env is not in .dockerignore: `COPY . .` would bake the secrets into the image"
    )


def test_web_and_worker_join_the_compose_redis_with_the_password_in_redis_url(tmp_path):
    password = os.urandom(16).hex()  # letters and digits, as docs/hosting.md and the file ask
    compose = YAML(typ="safe").load(COMPOSE.read_text())["services"]
    redis, port = start_compose_redis(tmp_path, password)
    worker = web = None
    try:
        # the healthcheck authenticates (REDISCLI_AUTH); without it redis-cli's ping would read NOAUTH
        env = {**os.environ, **interpolate(compose["redis"]["environment"], {"REDIS_PASSWORD": password})}
        test = compose["redis"]["healthcheck"]["test"]
        assert test[1] == "redis-cli"
        cli = [str(Path(redis_binary()).with_name("redis-cli")), "-p", str(port), *test[2:]]
        check = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0 and check.stdout.strip() == "PONG", check
        bare = subprocess.run(cli, capture_output=True, text=True, timeout=30)
        assert "NOAUTH" in bare.stdout + bare.stderr

        # the URL the file gives web and worker, pointed at this host's port in place of the service name
        urls = {interpolate(compose[name]["environment"]["REDIS_URL"], {"REDIS_PASSWORD": password})
                for name in ("web", "worker")}  # fmt: skip
        assert len(urls) == 1
        url = urls.pop().replace("@redis:6379/", f"@127.0.0.1:{port}/")
        worker = WorkerProcess(url, ["standin:100"], tmp_path / "worker.log")
        worker.wait_ready()
        web = WebServer(url, tmp_path)
        client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model="standin:100", prompt="abc", max_tokens=3)
        assert reply.usage.completion_tokens == 3 and reply.choices[0].text
    finally:
        for process in (web, worker):
            if process is not None:
                process.stop()
        redis.terminate()
        redis.wait(timeout=10)


def make_run_line(*args: str, env: dict | None = None) -> str:
    """The command `make run ARGS...` runs (make -n prints it)."""
    full = {**os.environ, **(env or {})}
    printed = subprocess.run(["make", "-n", "run", *args], cwd=ROOT, env=full, capture_output=True, text=True,
                             timeout=60, check=True).stdout  # fmt: skip
    return next(line.rstrip() for line in printed.splitlines() if "-m playground.run" in line)


def test_make_run_takes_the_models_and_playground_runs_options():
    line = make_run_line("MODEL=/ckpts/my-finetune,standin:30 /ckpts/other", "RUN_ARGS=--port 8123")
    assert line.endswith(
        "-m playground.run --model '/ckpts/my-finetune' --model 'standin:30' --model '/ckpts/other' --port 8123"
    )
    assert make_run_line().endswith("-m playground.run")
    # MODEL counts on make's command line only: the environment's may name something else entirely
    assert make_run_line(env={"MODEL": "gpt-4o"}).endswith("-m playground.run")


@pytest.mark.timeout(180)
def test_make_run_model_serves_that_model_only(tmp_path, redis_url):
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
           "LOG_FORMAT": "plain"}  # fmt: skip
    make = subprocess.Popen(["make", "run", "MODEL=standin:40", f"RUN_ARGS=--port {port}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    try:
        for line in make.stdout:
            lines.append(line)
            if "Playground: http://" in line:
                break
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as reply:
            assert [m["id"] for m in json.load(reply)["data"]] == ["standin:40"], "".join(lines)
    finally:
        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C, as in a terminal: playground.run stops what it started
        lines.append(make.communicate(timeout=60)[0])
    assert "stopping" in lines[-1], "".join(lines)
