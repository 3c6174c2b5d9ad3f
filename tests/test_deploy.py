"""Deployment files: docker-compose.yml against the Compose spec, and the healthchecks it runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
CHECK_JSONSCHEMA = Path(sys.executable).with_name("check-jsonschema")
VOLUME = re.compile(r"(.+):(/[^:]*)(?::ro|:rw)?")  # a service's volume: source, container path, mode


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
    )


def test_compose_file_follows_the_compose_spec(tmp_path):
    result = validate(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr
    # the check bites: a misspelt key in a service is refused
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("    healthcheck:\n", "    healthchek:\n", 1))
    assert validate(broken).returncode != 0


def test_compose_runs_redis_web_and_a_gpu_worker_from_one_image():
    services = YAML(typ="safe").load(COMPOSE.read_text())["services"]
    assert set(services) == {"redis", "web", "worker"}
    web, worker = services["web"], services["worker"]
    assert web["build"] == worker["build"] == "." and web["image"] == worker["image"]
    assert (ROOT / "Dockerfile").is_file()
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
            assert service["environment"]["REDIS_URL"] == "redis://redis:6379/0"
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
    dockerfile = (ROOT / "Dockerfile").read_text()
    commands = [part.split() for part in re.split(r"&&|\\\n|\n", dockerfile)]
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
