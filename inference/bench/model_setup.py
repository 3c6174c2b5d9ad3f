"""What the GPU benchmark and the probes of scripts/ start from: the refusal without a CUDA GPU, and the model
under test (a checkpoint directory, a Hub id, or a preset with random or peaked weights)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from common.names import parse_repo_ref
from inference.checkpoint import load_weights
from inference.config import ModelConfig
from inference.hub import fetch
from inference.model import Transformer
from inference.presets import PRESETS, preset_config
from inference.synth import make_peaked

INITS = ("random", "peaked")


def build_model(
    name: str, device: torch.device, dtype: torch.dtype, seed: int = 0, init: str | None = None
) -> Transformer:
    """A checkpoint directory, loaded; or a preset with `init` weights (default random): init_weights', or those
    turned into synth.make_peaked's model by the same generator."""
    path = Path(name)
    repo_ref = parse_repo_ref(name) if name not in PRESETS else None
    if repo_ref is not None:  # a Hub id: its snapshot in the HF cache, fetched as the worker fetches it
        path = fetch(*repo_ref)
    if path.is_dir():
        if init is not None:
            raise SystemExit(
                f"--init {init}: {name!r} is a checkpoint directory; --init applies to presets only"
            )
        cfg = ModelConfig.from_hf(path)
        return Transformer.from_weights(cfg, load_weights(path, cfg, device, dtype))
    if name not in PRESETS:
        raise SystemExit(
            f"--model: {name!r} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})"
        )
    if init not in (None, *INITS):
        raise SystemExit(f"--init: {init!r} is not one of {', '.join(INITS)}")
    cfg = ModelConfig.from_hf(preset_config(name))
    model = Transformer(cfg, device=device, dtype=dtype)
    generator = torch.Generator(device).manual_seed(seed)
    model.init_weights(generator=generator)
    if init == "peaked":
        make_peaked(model, generator)
    return model.eval().requires_grad_(False)  # as Transformer.from_weights: an inference model


def cuda_missing(tool: str) -> bool:
    """True, after saying so on stderr, when there is no CUDA GPU: the GPU tools' common refusal (exit 2)."""
    if torch.cuda.is_available():
        return False
    print(f"{tool}: needs a CUDA GPU", file=sys.stderr)
    return True
