"""How many rows a head screen of fewer bits would read again (CPU; no GPU needed).

kernels/lm_head_screen.py bounds each row's logit within +- |E| |x| (E: the row's rounding error in its int8
copy) and reads again in bf16 every row whose upper bound reaches the largest lower bound. Fewer bits halve the
screen's bytes but widen every bound; this counts the rows that would be read again, for the trained default
model at real positions of code and for a random head of llama's width:

    python scripts/screen_bits_probe.py [--positions 1000] [--random-rows 32768]

The x rounding term of the bound is left out (it only adds rows), so the counts are lower bounds.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from inference.engine import Engine  # noqa: E402
from inference.model import rms_norm  # noqa: E402

# (name, largest level, columns sharing a scale; None: one scale a row as shipped)
SCREENS = (("int8, a scale a row", 127, None), ("int6, a scale a row", 31, None), ("int4, a scale a row", 7, None),
           ("int4, a scale per 128 columns", 7, 128), ("int4, a scale per 32 columns", 7, 32))  # fmt: skip


def rounded(weight: torch.Tensor, levels: int, group: int | None) -> torch.Tensor:
    rows, cols = weight.shape
    tiles = weight.view(rows, 1 if group is None else cols // group, -1)
    scale = tiles.abs().amax(dim=2, keepdim=True).clamp_min(1e-30) / levels
    return (torch.round(tiles / scale).clamp(-levels, levels) * scale).view(rows, cols)


def rows_read_again(weight: torch.Tensor, xs: torch.Tensor, levels: int, group: int | None) -> torch.Tensor:
    """[positions]: the rows whose upper bound reaches the largest lower bound, at each input x."""
    approx_weight = rounded(weight, levels, group)
    bound = (weight - approx_weight).norm(dim=1)[None, :] * xs.norm(dim=1)[:, None]  # [positions, V]
    approx = xs @ approx_weight.T
    floor = (approx - bound).max(dim=1, keepdim=True).values
    return ((approx + bound) >= floor).sum(dim=1).double()


def head_inputs_of_default(positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The trained default model's head weight [V, K] and its normed inputs at `positions` tokens of this repo's
    code (teacher-forced), in float64."""
    engine = Engine.load(ROOT / "models" / "default", device="cpu")
    model, captured = engine.model, []
    head = model._head

    def capture(x):  # the head's input as _head computes it (lanes normed, then averaged)
        captured.append(rms_norm(x, model.norm[:, None], model.cfg.norm_eps).mean(0))
        return head(x)

    model._head = capture
    text = "".join(p.read_text() for p in sorted((ROOT / "inference").glob("*.py")))
    ids = engine.tokenizer.encode(text)[: min(positions, model.cfg.max_position_embeddings)]
    with torch.no_grad():
        model.forward(torch.tensor([ids]))
    weight = model.tok_embeddings if model.lm_head is None else model.lm_head
    return weight.double(), captured[0].double()


def report(title: str, weight: torch.Tensor, xs: torch.Tensor) -> None:
    print(f"{title}: head {tuple(weight.shape)}, {xs.shape[0]} inputs")
    for name, levels, group in SCREENS:
        counts = rows_read_again(weight, xs, levels, group)
        print(f"  {name:32s} rows read again: median {counts.median().item():,.0f}  "
              f"mean {counts.mean().item():,.1f}  max {counts.max().item():,.0f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=1000)
    parser.add_argument("--random-rows", type=int, default=32768)
    args = parser.parse_args()
    report("models/default (trained)", *head_inputs_of_default(args.positions))
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(args.random_rows, 2048, generator=generator) * 0.02
    report("random head of llama's width", weight, torch.randn(64, 2048, generator=generator))


if __name__ == "__main__":
    main()
