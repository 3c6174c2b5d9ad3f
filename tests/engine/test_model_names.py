"""Web and workers agree on model names (common/names.py): the web, which never loads a model, names
each MODELS entry as the worker that loads it does, so a hoster's `MODELS=/models/<folder>` is one model
that becomes ready, and a request while no worker is up is told to retry (503), not that the model
does not exist (400)."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest

from common import names
from common.names import ModelNameError, configured_models, model_source, served_name, served_names
from inference.checkpoint import CheckpointError
from inference.engine import Engine, resolve_model
from inference.synth import synth
from tests.support import ROOT


def test_default_model_falls_back_to_the_tiny_preset(tmp_path, monkeypatch):
    monkeypatch.setattr(names, "DEFAULT_MODEL_DIR", tmp_path / "default")
    assert names.default_model() == "tiny-laneformer"
    synth("tiny-llama", tmp_path / "default", seed=0)
    assert names.default_model() == str(tmp_path / "default")


def test_configured_models_the_arguments_then_models_then_the_default(monkeypatch):
    monkeypatch.delenv("MODELS", raising=False)
    assert configured_models() == [names.default_model()]
    monkeypatch.setenv("MODELS", " /models/a , tiny-qwen3,, ")
    assert configured_models() == ["/models/a", "tiny-qwen3"]
    assert configured_models(["standin:5"]) == ["standin:5"]


@pytest.mark.parametrize(
    "model, name",
    [
        ("tiny-qwen3", "tiny-qwen3"),
        ("standin:5e3", "standin:5000"),
        ("standin:fast", "standin:fast"),
        ("/models/my-finetune", "my-finetune"),
        ("/models/my-finetune/", "my-finetune"),
        ("/models/my-finetune/./", "my-finetune"),
        ("~/ckpt/v2", "v2"),
        (str(ROOT / "models" / "default"), "default"),
        # name=path, as vLLM's --served-model-name (a name may hold a "/", as the Hub's ids do)
        ("my-ft=/runs/a/checkpoint-500", "my-ft"),
        (" acme/coder = /runs/b/checkpoint-500/ ", "acme/coder"),
        ("fast=standin:500", "fast"),
        ("small=tiny-qwen3", "small"),
        # an entry that starts as a path does is one, whatever "=" it holds
        ("/runs/lr=3e-4/final", "final"),
        ("./lr=3e-4", "lr=3e-4"),
        # an HF cache snapshot: its repo's id, not its revision's hash
        ("/root/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B/snapshots/8f2b1c0d/", "Qwen/Qwen2.5-0.5B"),
        ("/hub/models--gpt2/snapshots/607a30d7", "gpt2"),
        ("/models/snapshots/v3", "v3"),  # no models--<repo> folder above: a folder like any other
        # the repo's folder itself (the engine loads the snapshot its refs/main names)
        ("/root/.cache/huggingface/hub/models--Qwen--Qwen3-1.7B/", "Qwen/Qwen3-1.7B"),
        ("~/hub/models--gpt2", "gpt2"),
    ],
)
def test_served_name_from_the_text_alone(model, name):
    assert served_name(model) == name


def test_served_name_is_what_the_engine_announces(tmp_path):
    path = synth("tiny-llama", tmp_path / "my-finetune", seed=0)
    assert Engine.load(f"{path}/", device="cpu").name == served_name(f"{path}/") == "my-finetune"
    assert Engine.load("tiny-llama", device="cpu").name == served_name("tiny-llama")


def models_of(web) -> dict[str, int]:
    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="none", max_retries=0, timeout=30)
    return {model.id: model.model_extra["workers"] for model in client.models.list().data}


def test_a_hosted_folder_is_one_model_that_becomes_ready(start_web, start_worker, tmp_path):
    folder = synth("tiny-llama", tmp_path / "models" / "my-finetune", seed=0)
    web = start_web({"MODELS": f"{folder}/"})  # as a hoster writes it; the web has no weights to look at
    assert models_of(web) == {"my-finetune": 0}
    start_worker([f"{folder}/"])
    assert models_of(web) == {"my-finetune": 1}
    ready = httpx.get(f"{web.url}/readyz", timeout=60)  # a generation through the worker, by that name
    assert ready.status_code == 200 and set(ready.json()["models"]) == {"my-finetune"}, ready.text


def test_without_models_the_web_expects_the_default_and_asks_to_retry_while_no_worker_is_up(
    start_web, monkeypatch
):
    monkeypatch.delenv("MODELS", raising=False)
    web = start_web()
    default = served_name(names.default_model())
    assert models_of(web) == {default: 0}
    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.InternalServerError) as refused:  # 503: the openai client retries these
        client.completions.create(model=default, prompt="def f(", max_tokens=2)
    assert refused.value.status_code == 503 and refused.value.body["code"] == "no_workers"
    assert refused.value.response.headers["Retry-After"] == "5"  # a lost worker is started again in seconds
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="nope", prompt="def f(", max_tokens=2)
    assert unknown.value.status_code == 404 and unknown.value.body["code"] == "model_not_found"


def test_the_folder_copied_elsewhere_keeps_its_name(tmp_path):
    # Web and worker may see the folder at different places (a bind mount): only its name counts.
    folder = synth("tiny-llama", tmp_path / "a" / "ft", seed=0)
    moved = shutil.copytree(folder, tmp_path / "b" / "ft")
    assert served_name(str(folder)) == served_name(str(moved)) == Engine.load(moved, device="cpu").name


def test_the_model_list_holds_still_however_the_heartbeats_fall(settings):
    from playground.jobs import served_models, spec_from_frame

    settings.PLAYGROUND_MODELS = ["default", "my-coder-ft", "idle-ft"]
    beats = [
        {
            "models": ["my-coder-ft"],
            "model_info": {
                "my-coder-ft": {"chat": True, "max_context": 4096, "sampling_defaults": {"temperature": 0.7}}
            },
        },
        {"models": ["default"]},
        {"models": ["zeta-extra", "alpha-extra"]},
    ]
    listed = [list(served_models(order)) for order in (beats, beats[::-1], beats[1:] + beats[:1])]
    # live ones first in MODELS' order, then live extras by name, then configured ones no worker serves
    assert listed == [["default", "my-coder-ft", "alpha-extra", "zeta-extra", "idle-ft"]] * 3
    models = served_models(beats)
    assert models["my-coder-ft"] == {
        "chat": True,
        "base": False,  # a heartbeat that does not say it continues code: the page invites a request
        "max_context": 4096,
        "sampling_defaults": {"temperature": 0.7},
        "template_kwargs": False,
        "fim": False,
        "fim_tokens": None,
        "logprobs": False,
        "tokenize": False,
        "prompt_ids": False,
        "workers": 1,
    }  # fmt: skip (a heartbeat that does not say what it does besides generating: it is taken not to)
    assert models["default"]["sampling_defaults"] == {}  # a worker that says none
    assert models["idle-ft"]["workers"] == 0
    assert spec_from_frame({"prompt": "def f("}, models).model == "default"  # a frame without a model
    assert spec_from_frame({"prompt": "def f("}, served_models(beats[:1])).model == "my-coder-ft"


def test_two_entries_of_one_name_are_refused_naming_both_and_a_name_tells_them_apart():
    runs = ["/runs/a/checkpoint-500", "/runs/b/checkpoint-500/"]
    with pytest.raises(ModelNameError) as clash:
        served_names(runs)
    assert str(clash.value) == (
        "'/runs/a/checkpoint-500' and '/runs/b/checkpoint-500/' would both be served as 'checkpoint-500': give "
        "one another name with name=path (e.g. checkpoint-500-2=/runs/b/checkpoint-500/), or rename a folder"
    )
    snapshots = [f"/hub/models--acme--coder/snapshots/{revision}" for revision in ("1111", "2222")]
    with pytest.raises(ModelNameError, match="would both be served as 'acme/coder'"):
        served_names(snapshots)
    assert served_names(["a500=" + runs[0], "b500=" + runs[1]]) == {
        "a500": "a500=" + runs[0],
        "b500": "b500=" + runs[1],
    }
    assert [model_source(e) for e in ("b500=" + runs[1], runs[0])] == [runs[1], runs[0]]
    for empty in ("=/runs/a", "name=", " = "):
        with pytest.raises(ModelNameError, match="expected name=path with neither empty"):
            served_names([empty])


def test_a_named_entry_loads_its_path_under_its_name(tmp_path):
    path = synth("tiny-llama", tmp_path / "checkpoint-500", seed=0)
    engine = Engine.load(f"run-a={path}", device="cpu")
    assert engine.name == served_name(f"run-a={path}") == "run-a" and engine.path == path
    assert Engine.load("small=tiny-llama", device="cpu").name == "small"


def test_named_entries_and_a_snapshot_are_served_by_the_names_the_web_expects(
    start_web, start_worker, tmp_path
):
    run = synth("tiny-llama", tmp_path / "runs" / "a" / "checkpoint-500", seed=0)
    # as the Hub's cache lays a repo out (the files themselves here, where the cache links them to blobs/)
    snapshot = synth("tiny-qwen3", tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abcd", seed=0)
    models = [f"acme/coder={run}", str(snapshot), "fast=standin:500"]
    web = start_web({"MODELS": ",".join(models)})
    assert models_of(web) == {"acme/coder": 0, "acme/tiny": 0, "fast": 0}
    worker = start_worker(models)
    assert models_of(web) == {"acme/coder": 1, "acme/tiny": 1, "fast": 1}
    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="none", max_retries=0, timeout=60)
    for name in ("acme/coder", "acme/tiny", "fast"):
        assert client.models.retrieve(name).id == name
        done = client.completions.create(model=name, prompt="def f(", max_tokens=2, temperature=0)
        assert done.model == name and done.usage.completion_tokens >= 1
    assert "acme/coder, acme/tiny, fast" in worker.log_path.read_text()  # "worker ... serving ..."


def test_an_hf_cache_repo_folder_loads_the_snapshot_its_refs_main_names(tmp_path):
    """A person finds `models--Org--Name` in ~/.cache/huggingface/hub and gives that: the snapshot refs/main names
    loads (huggingface_hub writes refs/main with each download, and resolves it here); a ref naming a snapshot
    that is gone is refused in one line."""
    repo = tmp_path / "hub" / "models--acme--tiny"
    synth(
        "tiny-llama", repo / "snapshots" / "1111aaaa", seed=0
    )  # an older revision, which refs/main no longer names
    new = synth("tiny-qwen3", repo / "snapshots" / "2222bbbb", seed=0)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("2222bbbb")  # as huggingface_hub writes it: the hash, no newline
    assert resolve_model(repo) == new
    engine = Engine.load(str(repo), device="cpu")
    assert engine.name == served_name(str(repo)) == "acme/tiny" and engine.path == new
    assert engine.config.model_type == "qwen3"
    assert resolve_model(f"{repo}/") == new
    (repo / "refs" / "main").write_text("3333cccc")  # a revision whose snapshot is gone
    with pytest.raises(
        CheckpointError, match="models--acme--tiny: an HF cache folder whose refs/main names no snapshot"
    ):
        Engine.load(str(repo), device="cpu")
    # a checkpoint folder of that name (its own config.json) is a checkpoint folder
    plain = synth("tiny-llama", tmp_path / "models--mine", seed=0)
    assert resolve_model(plain) == plain
