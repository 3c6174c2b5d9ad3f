"""Which models a deployment serves, and the name each is served under, known without loading anything.

The web process has no torch, yet it must agree with the workers on names: a request, the page's model
picker, /v1/models and /readyz all use the name a worker announces in its heartbeat (Engine.name).
Both sides read the same `MODELS` list (checkpoint folders or preset names; empty: the shipped default)
and name each entry with `served_name`.
"""

from __future__ import annotations

import os
from pathlib import Path

from inference.presets import PRESETS
from inference.standin import PREFIX as STANDIN_PREFIX

# The shipped model (trained by inference/train.py); the tiny synthetic preset stands in until it exists.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "default"


def default_model() -> str:
    return str(DEFAULT_MODEL_DIR) if (DEFAULT_MODEL_DIR / "config.json").is_file() else "tiny-laneformer"


def configured_models(models: list[str] | None = None) -> list[str]:
    """The models to serve: `models` if given, else the MODELS variable, else the shipped default."""
    if models:
        return list(models)
    from_env = [m.strip() for m in os.environ.get("MODELS", "").split(",") if m.strip()]
    return from_env or [default_model()]


def served_name(model: str | Path) -> str:
    """The name `model` is served under: a preset's or stand-in's own name, else its folder's name
    (`/models/my-finetune/` -> `my-finetune`), worked out from the text alone, so that a web process
    without the folder names it as the worker that loads it does."""
    model = str(model)
    if model in PRESETS:
        return model
    if model.startswith(STANDIN_PREFIX):
        try:  # StandinEngine's own spelling of its rate (`standin:5e3` is served as `standin:5000`)
            return f"{STANDIN_PREFIX}{float(model.removeprefix(STANDIN_PREFIX)):g}"
        except ValueError:
            return model  # the worker refuses it at start; the name does not matter then
    return os.path.basename(os.path.normpath(os.path.abspath(os.path.expanduser(model))))
