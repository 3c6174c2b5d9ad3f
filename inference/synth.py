"""Write a random-weight checkpoint in the real on-disk format: config.json, generation_config.json,
safetensors (sharded with an index past 2 GB, as the Hub does) and the tokenizer files.

    python -m inference.synth --preset laneformer-2b --out /tmp/lf2b [--seed 0]

Tensors are generated and written one shard at a time, so a 2B model needs about one shard of RAM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from inference.checkpoint import checkpoint_shapes
from inference.config import ModelConfig
from inference.presets import PRESETS, preset_config
from inference.tokenizer_build import write_synthetic_tokenizer

SHARD_BYTES = 2 * 1024**3


def synth(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    raw = preset_config(preset)
    cfg = ModelConfig.from_hf(raw)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    special = write_synthetic_tokenizer(out_dir, PRESETS[preset]["chat_format"], cfg.vocab_size)
    eos = special["eos_token_id"]
    raw.update(bos_token_id=special["bos_token_id"], eos_token_id=eos[0] if len(eos) == 1 else eos)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    generation = {"bos_token_id": special["bos_token_id"], "eos_token_id": eos, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    dtype = torch.bfloat16 if raw.get("torch_dtype") == "bfloat16" else torch.float32
    _write_weights(out_dir, checkpoint_shapes(cfg), dtype, seed)
    return out_dir


def _random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    # Unit RMSNorm scales and zero biases, as a freshly initialised model. Matrices get std 1/sqrt(fan_in)
    # so that every block moves the residual stream as much as the embedding does: with a smaller scale
    # a small model's output is its input echoed back, and greedy decoding repeats one token forever.
    if "norm" in name:
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    return torch.empty(shape).normal_(0.0, shape[-1] ** -0.5, generator=generator)


def _write_weights(out_dir: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, seed: int) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = itemsize * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes

    generator = torch.Generator().manual_seed(seed)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        tensors = {n: _random_tensor(n, shapes[n], generator).to(dtype) for n in shards[0]}
        save_file(tensors, out_dir / "model.safetensors", metadata=metadata)
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _random_tensor(n, shapes[n], generator).to(dtype) for n in names}
        save_file(tensors, out_dir / file, metadata=metadata)
        del tensors
        weight_map.update(dict.fromkeys(names, file))
    total = sum(itemsize * torch.Size(s).numel() for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.synth", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = synth(args.preset, args.out, args.seed)
    print(f"wrote {args.preset} (seed {args.seed}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
