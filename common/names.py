"""Which models a deployment serves, and the name each is served under, known without loading anything.

The web process has no torch, yet it must agree with the workers on names: a request, the page's model
picker, /v1/models and /readyz all use the name a worker announces in its heartbeat (Engine.name).
Both sides read the same `MODELS` list (checkpoint folders or preset names; empty: the shipped default)
and name each entry with `served_name`. An entry may name its model itself, `name=path` (as vLLM's
--served-model-name does): two runs' `checkpoint-500` folders, or any folder whose name is not the one to show.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# The shipped model (trained by inference/train.py); the tiny synthetic preset stands in until it exists.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "default"
# An HF cache's folder for a model repo: models--<org>--<name>/snapshots/<revision hash>/
HF_CACHE_PREFIX = "models--"
# A model named `standin:<tokens/s>` is the torch-free stand-in engine (inference/standin.py)
STANDIN_PREFIX = "standin:"
# How a MODELS / --model entry that is a path (never `name=path`) may start
PATH_STARTS = ("/", ".", "~", os.sep)
# A Hugging Face Hub repo id, `Org/Name`, with an optional `@revision` (a branch, tag or commit)
REPO_REF = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")


def default_model() -> str:
    return str(DEFAULT_MODEL_DIR) if (DEFAULT_MODEL_DIR / "config.json").is_file() else "tiny-laneformer"


def configured_models(models: list[str] | None = None) -> list[str]:
    """The models to serve: `models` if given, else the MODELS variable, else the shipped default."""
    if models:
        return list(models)
    from_env = [m.strip() for m in os.environ.get("MODELS", "").split(",") if m.strip()]
    return from_env or [default_model()]


class ModelNameError(ValueError):
    """MODELS / --model entries that cannot all be served: an empty name or path, or one name twice."""


def split_entry(entry: str | Path) -> tuple[str | None, str]:
    """A MODELS / --model entry as (the name it gives, or None; the folder, preset or stand-in).

    `name=path` gives a name, which may hold a `/` (`acme/coder=/models/run3`, an id as the Hub spells
    one). An entry that starts as a path does (`/`, `.`, `~`) is a path whatever it holds:
    `/runs/lr=3e-4/final`, `./lr=3e-4`."""
    entry = str(entry).strip()
    head, equals, tail = entry.partition("=")
    if not equals or entry.startswith(PATH_STARTS):
        return None, entry
    return head.strip(), tail.strip()


def model_source(entry: str | Path) -> str:
    """What an entry loads: its path (or preset, or stand-in), without the name it may give."""
    return split_entry(entry)[1]


def served_name(model: str | Path) -> str:
    """The name `model` (a MODELS / --model entry) is served under: the one it gives (`name=path`), a
    preset's or stand-in's own name, the repo id of an HF cache snapshot
    (`.../models--Org--Name/snapshots/<hash>` -> `Org/Name`, as the Hub and vLLM name it), else its folder's
    name (`/models/my-finetune/` -> `my-finetune`), a Hub id as it is (`Org/Name@v2` -> `Org/Name`); worked out from the text alone, so that a web process
    without the folder names it as the worker that loads it does."""
    name, model = split_entry(model)
    if name:
        return name
    # A preset's name (tiny-laneformer, qwen3-1.7b) holds no `/` and no `=`: the folder rule below gives it back.
    repo_ref = parse_repo_ref(model)
    if repo_ref is not None:  # a Hub id, served under it without its revision, as vLLM serves one
        return repo_ref[0]
    if model.startswith(STANDIN_PREFIX):
        try:  # StandinEngine's own spelling of its rate (`standin:5e3` is served as `standin:5000`)
            return f"{STANDIN_PREFIX}{float(model.removeprefix(STANDIN_PREFIX)):g}"
        except ValueError:
            return model  # the worker refuses it at start; the name does not matter then
    parts = os.path.normpath(os.path.abspath(os.path.expanduser(model))).split(os.sep)
    # huggingface_hub names a repo's folder "models--" + the repo id with "/" as "--" (which a repo id may not hold
    # itself); the engine loads that folder's snapshot (hub.resolve_cache_folder)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith(HF_CACHE_PREFIX):
        return parts[-3].removeprefix(HF_CACHE_PREFIX).replace("--", "/")
    if parts[-1].startswith(HF_CACHE_PREFIX) and len(parts[-1]) > len(HF_CACHE_PREFIX):
        return parts[-1].removeprefix(HF_CACHE_PREFIX).replace("--", "/")
    return parts[-1]


def is_hf_cache_repo(path: Path) -> bool:
    """Whether `path` is an HF cache's folder for a repo (models--Org--Name, holding snapshots/)."""
    return path.name.startswith(HF_CACHE_PREFIX) and (path / "snapshots").is_dir()


def served_names(entries: list[str]) -> dict[str, str]:
    """{served name: entry} for every entry, refusing (ModelNameError) an entry with an empty name or path,
    and two entries served under one name, naming both: a clash found in a second, before anything loads."""
    taken: dict[str, str] = {}
    for entry in entries:
        name, source = split_entry(entry)
        if name == "" or not source:
            raise ModelNameError(f"{entry!r}: expected name=path with neither empty (or a path alone)")
        served = served_name(entry)
        if served in taken:
            raise ModelNameError(
                f"{taken[served]!r} and {entry!r} would both be served as {served!r}: give one another "
                f"name with name=path (e.g. {served}-2={source}), or rename a folder"
            )
        taken[served] = entry
    return taken


def parse_repo_ref(entry: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `entry` spells a Hub id and names no existing path, else None: a
    folder `runs/final` next to the worker is that folder, as it always was."""
    found = REPO_REF.fullmatch(entry.strip())
    if found is None or os.path.exists(os.path.expanduser(entry.strip())):
        return None
    return found["repo"], found["revision"]
