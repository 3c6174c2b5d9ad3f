"""Web and workers agree on model names (inference/names.py): the web, which never loads a model, names
each MODELS entry as the worker that loads it does, so a hoster's `MODELS=/models/<folder>` is one model
that becomes ready, and a request while no worker is up is told to retry (503), not that the model
does not exist (400)."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
from conftest import ROOT

from inference import names
from inference.engine import Engine
from inference.names import configured_models, served_name
from inference.synth import synth


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
        {"models": ["my-coder-ft"], "model_info": {"my-coder-ft": {"chat": True, "max_context": 4096}}},
        {"models": ["default"]},
        {"models": ["zeta-extra", "alpha-extra"]},
    ]
    listed = [list(served_models(order)) for order in (beats, beats[::-1], beats[1:] + beats[:1])]
    # live ones first in MODELS' order, then live extras by name, then configured ones no worker serves
    assert listed == [["default", "my-coder-ft", "alpha-extra", "zeta-extra", "idle-ft"]] * 3
    models = served_models(beats)
    assert models["my-coder-ft"] == {"chat": True, "max_context": 4096, "workers": 1}
    assert models["idle-ft"]["workers"] == 0
    assert spec_from_frame({"prompt": "def f("}, models).model == "default"  # a frame without a model
    assert spec_from_frame({"prompt": "def f("}, served_models(beats[:1])).model == "my-coder-ft"
