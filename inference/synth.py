"""Write a random-weight checkpoint in the real on-disk format: config.json, generation_config.json,
safetensors (sharded with an index past 2 GB, as the Hub does) and the tokenizer files.

    python -m inference.synth --preset laneformer-2b --out /tmp/lf2b [--seed 0] [--peaked]

Tensors are generated and written one shard at a time, so a 2B model needs about one shard of RAM.
--peaked writes make_peaked's model instead (built whole in memory first, then written the same way).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from inference import checkpoint
from inference.checkpoint import checkpoint_shapes
from inference.config import ModelConfig
from inference.model import Transformer
from inference.presets import PRESETS, preset_config
from inference.tokenizer_build import write_synthetic_tokenizer

SHARD_BYTES = 2 * 1024**3


def synth(preset: str, out_dir: str | Path, seed: int = 0, peaked: bool = False) -> Path:
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
    if peaked:
        _write_weights(out_dir, checkpoint_shapes(cfg), dtype, _model_tensors(peaked_model(cfg, seed, dtype)))
    else:
        generator = torch.Generator().manual_seed(seed)
        _write_weights(
            out_dir, checkpoint_shapes(cfg), dtype, lambda n, shape: _random_tensor(n, shape, generator)
        )
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


def _write_weights(
    out_dir: Path,
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    tensor: Callable[[str, tuple[int, ...]], torch.Tensor],
) -> None:
    """Write tensor(name, shape) for every checkpoint name, in order, one shard at a time."""
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

    metadata = {"format": "pt"}
    if len(shards) == 1:
        tensors = {n: tensor(n, shapes[n]).to(dtype) for n in shards[0]}
        save_file(tensors, out_dir / "model.safetensors", metadata=metadata)
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: tensor(n, shapes[n]).to(dtype) for n in names}
        save_file(tensors, out_dir / file, metadata=metadata)
        del tensors
        weight_map.update(dict.fromkeys(names, file))
    total = sum(itemsize * torch.Size(s).numel() for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# --- the peaked model ------------------------------------------------------------------------------------

# In units of the spread (std) of the logits of the tokens no pointer names; HEAD_NORM sets that spread. The
# largest of those V logits sits about sqrt(2 ln V) std above their mean (4.3 std at V = 32000).
HEAD_NORM = 2.0  # row norm of the embedding and of the head: logits spread like a trained model's (std ~2)
CANDIDATE_MARGIN = 3.0  # the weaker pointed-at token above the expected largest of all the others
FORK_LEAD = (
    1.0  # untied head: the preferred successor's lead over the second one before the layers add theirs
)
CALIBRATION_TOKENS, CALIBRATION_SKIP, CALIBRATION_ROUNDS = 160, 32, 5


@torch.no_grad()
def make_peaked(model: Transformer, generator: torch.Generator) -> dict:
    """Turn a freshly initialised model (init_weights) into the "peaked" synthetic model, in place.

    Why: with init_weights' weights the logits are flat, the top two often closer than bf16 rounding, so no bf16
    implementation can match fp32's argmax at 99% of steps and the argmax rule measures nothing. A trained
    model's logits are peaked. This model keeps init_weights' random layers, with one gain on every block's
    output projections (wo, w2), and makes the residual stream's embedding part point at two next tokens:
      * untied head: each token has a preferred and a second successor (two fixed random permutations). Head row
        v is the normalised sum of the embedding of the token that prefers v and, weaker by the factor that puts
        FORK_LEAD between them, of the one that has v second. Successor chains are long: greedy runs wander.
      * tied head: the embedding is the head, which can only score tokens symmetrically (v after t as much as t
        after v), so a pointer of its own would send every run into a two-token loop. Tokens sit on one random
        cycle instead, each scoring its two neighbours about equally (they differ by a random fraction of the
        logits' spread) and itself about zero: E = (p, q) over two random halves of the dimensions, with
        p = (r + r_next) / 2, q = (r - r_next) / 2 and a final norm scale of -1 on q's half.
    The gain is calibrated on random tokens so that the weaker of the two candidates stands CANDIDATE_MARGIN std
    above the expected largest of the other logits (a narrow model that cannot reach it gets 80% of its best).

    What it guarantees: the two candidates lead every other token by a wide margin at nearly every step, and
    which of them wins is decided by what the layers add to the skip path's own preference (untied: by
    FORK_LEAD; tied: by the random difference of the two neighbours). The top logit is far below the logit
    vector's norm (a few % of its square at most), so the relative error still weighs every logit. Not
    guaranteed: the share of steps the layers turn, the margins, and whether a greedy run falls into a loop
    (tied heads do, having no direction to walk in) depend on the shapes; bench.correctness.check measures
    them.
    Deterministic given the generator (on the model's device: CPU, or CUDA as bench builds it). Returns the
    chosen gain and the z-score reached."""
    cfg, device = model.cfg, model.tok_embeddings.device
    target = _expected_max(cfg.vocab_size - 2) + CANDIDATE_MARGIN
    units = _unit_rows(model.tok_embeddings.float())
    if model.lm_head is None:
        candidates = _tied_cycle(model, units, generator)
    else:
        candidates = _untied_fork(model, units, generator, lead=FORK_LEAD / target)
    tokens = torch.randint(0, cfg.vocab_size, (CALIBRATION_TOKENS,), generator=generator, device=device)
    gain, z = _calibrate_block_gain(model, tokens, candidates, target)
    return {"block_gain": gain, "candidate_z": z, "target_z": target}


def peaked_model(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Transformer:
    """The peaked model synth writes: init_weights then make_peaked, one CPU generator seeded with `seed`."""
    model = Transformer(cfg, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    model.init_weights(generator=generator)
    make_peaked(model, generator)
    return model.eval()


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def _expected_max(n: int) -> float:
    """Median of the largest of n independent standard normal values."""
    return torch.special.ndtri(torch.tensor(0.5 ** (1 / n), dtype=torch.float64)).item()


def _untied_fork(
    model: Transformer, units: torch.Tensor, generator: torch.Generator, lead: float
) -> torch.Tensor:
    """Embeddings: init's random directions at norm HEAD_NORM; head rows: each token's two successors, the second
    trailing the first by `lead` of the weaker's logit. Returns the successors, [V, 2]."""
    V, device = model.cfg.vocab_size, units.device
    model.tok_embeddings.copy_(units * HEAD_NORM)
    first = torch.randperm(V, generator=generator, device=device)
    second = torch.randperm(V, generator=generator, device=device)
    rows = torch.zeros_like(units)
    rows[first] += units
    rows[second] += units / (1 + lead)
    _set_head_rows(model, _unit_rows(rows) * HEAD_NORM)
    return torch.stack((first, second), dim=1)


def _set_head_rows(model: Transformer, rows: torch.Tensor) -> None:
    """rows [V, D]: what each token's logit reads from one lane's normalised stream, for every head type."""
    cfg = model.cfg
    if cfg.lm_head_type == "lane":  # one row over the concatenated lanes: every lane carries the embedding
        rows = rows.repeat(1, cfg.num_lanes) / math.sqrt(cfg.num_lanes)
    model.lm_head.copy_(rows.reshape(model.lm_head.shape))


def _tied_cycle(model: Transformer, units: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Tokens on one random cycle, each embedding scoring its neighbours under a final norm signed -1 on half the
    dimensions: p.p' - q.q' = (1 + r.r'') / 2 for neighbours, r.r' for the token itself. Returns them, [V, 2]."""
    V, D, device = model.cfg.vocab_size, model.cfg.hidden_size, units.device
    half = D // 2
    dims = torch.randperm(D, generator=generator, device=device)
    plus, minus = dims[:half], dims[half : 2 * half]
    order = torch.randperm(V, generator=generator, device=device)  # order[i]'s neighbours: order[i -+ 1]
    r = _unit_rows(units[order, :half])  # init's random directions, one per place on the cycle
    r_next = r.roll(-1, dims=0)
    rows = torch.zeros(V, D, device=device)
    rows[order[:, None], plus] = (r + r_next) / 2
    rows[order[:, None], minus] = (r - r_next) / 2
    model.tok_embeddings.copy_(_unit_rows(rows) * HEAD_NORM)
    sign = torch.ones(D, device=device)
    sign[minus] = -1.0
    model.norm.mul_(sign.to(model.norm.dtype))
    neighbours = torch.empty(V, 2, dtype=torch.long, device=device)
    neighbours[order, 0] = order.roll(-1)
    neighbours[order, 1] = order.roll(1)
    return neighbours


def _calibrate_block_gain(
    model: Transformer, tokens: torch.Tensor, candidates: torch.Tensor, target: float
) -> tuple[float, float]:
    """Scale every wo and w2 by one gain so that the weaker candidate's z-score (median over the positions of a
    random sequence) is `target`. The z-score falls like z0 / sqrt(1 + (gain / g0)^2) as the blocks' share of
    the residual stream grows (z0: with no block output); a few rounds of that formula solve for the gain."""
    originals = [(layer.wo.clone(), layer.w2.clone()) for layer in model.layers]

    def z_at(gain: float) -> float:
        for layer, (wo, w2) in zip(model.layers, originals, strict=True):
            layer.wo.copy_(wo * gain)
            layer.w2.copy_(w2 * gain)
        return _weaker_candidate_z(model, tokens, candidates)

    z0 = z_at(0.0)
    target = min(
        target, 0.8 * z0
    )  # a narrow model cannot reach the margin: keep the blocks small but present
    gain, z = 1.0, z_at(1.0)
    for _ in range(CALIBRATION_ROUNDS):
        gain *= _gain_step(z, z0, target)
        z = z_at(gain)
    return gain, z


def _gain_step(z: float, z0: float, target: float) -> float:
    """The factor on the gain that z0 / sqrt(1 + (gain / g0)^2) predicts moves z to target; at most 8x a round."""
    if z <= 0:  # the blocks drown the candidates altogether
        return 0.125
    step = math.sqrt((z0**2 / target**2 - 1) / max(z0**2 / z**2 - 1, 1e-6))
    return min(max(step, 0.125), 8.0)


def _weaker_candidate_z(model: Transformer, tokens: torch.Tensor, candidates: torch.Tensor) -> float:
    logits = model(tokens[None])[0, CALIBRATION_SKIP:].float()  # [T, V]
    named = candidates[tokens[CALIBRATION_SKIP:]]  # [T, 2]
    weaker = logits.gather(1, named).min(dim=1).values
    rest = logits.scatter(1, named, float("nan"))
    mean = rest.nanmean(dim=1)
    std = (rest - mean[:, None]).pow(2).nanmean(dim=1).sqrt()
    return ((weaker - mean) / std).median().item()


def _model_tensors(model: Transformer) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """The checkpoint tensor of each name, read back from the model (checkpoint.checkpoint_tensor), one at a time."""
    state = model.state_dict()
    entries = {e.name: e for e in checkpoint.checkpoint_entries(model.cfg)}
    return lambda name, shape: checkpoint.checkpoint_tensor(entries[name], state[entries[name].internal])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.synth", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--peaked", action="store_true", help="make_peaked's weights: logits with a trained model's margins"
    )
    args = parser.parse_args(argv)
    out = synth(args.preset, args.out, args.seed, args.peaked)
    print(f"wrote {args.preset} ({'peaked, ' if args.peaked else ''}seed {args.seed}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
