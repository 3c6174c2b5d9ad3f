"""Models by Hub repo id, end to end: a real worker fetches `acme/tiny-coder` through the real huggingface_hub from a
local endpoint in the Hub's layout (HF_ENDPOINT; tests/support/hub_server.py), the page's and the API's model list
shows its progress, an interrupted download resumes, the model is served by name (FIM included), and again with
the network gone (HF_HUB_OFFLINE=1). A name the Hub does not know, a gated repo without a token and no network
with nothing cached each end the worker with one line, nothing left in the cache."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import redis

from common.protocol import worker_key
from tests.support.fim_checkpoint import write_fim_checkpoint
from tests.support.hub_server import COMMIT, HubServer

REPO = "acme/tiny-coder"
LOAD_EXIT_CODE = 78


@pytest.fixture
def hub(tmp_path):
    # 25 MB of weights: huggingface_hub writes and reports a download 10 MB at a time
    checkpoint = write_fim_checkpoint(tmp_path / "repo", intermediate_size=16384)
    (checkpoint / "pytorch_model.bin").write_bytes(b"a pickle, which must never be fetched")
    server = HubServer({REPO: checkpoint, "acme/gated": checkpoint}, gated=frozenset({"acme/gated"}))
    yield server
    server.stop()


def hub_env(hub, tmp_path, **more) -> dict:
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_TOKEN": "",
        "HF_HUB_OFFLINE": "0",
        **more,
    }


def wait_for(condition, timeout_s: float = 60, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


def listed_download(web) -> dict | None:
    models = httpx.get(web.url + "/v1/models", timeout=10).json()["data"]
    return next((m.get("download") for m in models if m["id"] == REPO and m.get("download")), None)


def test_a_model_by_repo_id_resumes_serves_and_serves_again_offline(hub, tmp_path, start_worker, start_web):
    hub.slow_s = 0.02  # 64 KB every 20 ms, about 3 MB/s: a download the test can watch and interrupt
    web = start_web()
    env = hub_env(hub, tmp_path)
    first = start_worker([REPO], env=env, wait=False)
    weights = (hub.repos[REPO] / "model.safetensors").stat().st_size
    # the small files arrive at once and count too: past their bytes, the weights' part file is being written
    progress = wait_for(
        lambda: (d := listed_download(web)) and d["done"] > d["total"] - weights and d,
        what="no progress on the weights",
    )
    assert 0 < progress["done"] < progress["total"]
    first.kill()  # mid-download, no goodbye
    blobs = tmp_path / "hf" / "hub" / "models--acme--tiny-coder" / "blobs"
    assert [p.name for p in blobs.iterdir() if p.name.endswith(".incomplete")]  # the part fetched so far
    assert not (blobs.parent / "snapshots" / COMMIT / "model.safetensors").exists()  # never half a file there

    hub.slow_s = 0.0
    hub.cut_once.add("model.safetensors")  # and this time the connection breaks half-way through the weights
    worker = start_worker([REPO], env=env)
    assert "a part a stopped download left" in worker.log_path.read_text()
    resumed = [r for m, path, r in hub.requests if m == "GET" and path.endswith("model.safetensors") and r]
    assert (
        resumed and int(resumed[-1].removeprefix("bytes=").rstrip("-")) > 0
    )  # went on from the bytes it had
    assert not list(blobs.glob("*.incomplete"))
    assert not any(path.endswith(".bin") for _, path, _ in hub.requests)  # the pickle was never asked for
    snapshot = blobs.parent / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip

    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="-", max_retries=0, timeout=60)
    assert client.models.retrieve(REPO).model_extra["fim"] is True
    kwargs = {
        "model": REPO,
        "prompt": "def f(x):\n    return ",
        "suffix": "\n",
        "max_tokens": 6,
        "temperature": 0,
    }
    online = client.completions.create(**kwargs).choices[0].text
    worker.stop()

    hub.stop()  # the network is gone
    offline = start_worker([REPO], env=hub_env(hub, tmp_path, HF_HUB_OFFLINE="1"))
    assert "from the HF cache, offline" in offline.log_path.read_text()
    assert client.completions.create(**kwargs).choices[0].text == online


@pytest.mark.parametrize(
    "model, env, line",
    [
        (
            "acme/missing",
            {},
            "acme/missing: no such model repository on the Hub (a private one needs HF_TOKEN)",
        ),
        ("acme/gated", {}, "acme/gated: a gated repository: accept its terms on the Hub, then set HF_TOKEN"),
        (
            "acme/tiny-coder@v9",
            {},
            "acme/tiny-coder@v9: no such revision (branch, tag or commit) in the repository",
        ),
        (REPO, {"HF_ENDPOINT": "http://127.0.0.1:9"}, "acme/tiny-coder: not in the HF cache ("),
        (REPO, {"HF_HUB_OFFLINE": "1"}, "acme/tiny-coder: not in the HF cache ("),
    ],
)
def test_a_repo_that_cannot_be_fetched_is_one_line_and_nothing_in_the_cache(hub, tmp_path, start_worker, model, env,
                                                                             line, redis_url):  # fmt: skip
    worker = start_worker([model], env=hub_env(hub, tmp_path, **env), wait=False)
    assert worker.process.wait(timeout=120) == LOAD_EXIT_CODE
    errors = [
        json.loads(row) for row in worker.log_path.read_text().splitlines() if '"level": "ERROR"' in row
    ]
    assert len(errors) == 1 and line in errors[0]["msg"], worker.log_path.read_text()
    assert "Traceback" not in worker.log_path.read_text()
    hub_cache = tmp_path / "hf" / "hub"
    assert not list(hub_cache.glob("models--*/snapshots/*/*")) and not list(
        hub_cache.glob("models--*/blobs/*")
    )
    assert not redis.Redis.from_url(redis_url).exists(
        worker_key(worker.worker_id)
    )  # no heartbeat left behind
