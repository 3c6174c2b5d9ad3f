"""Next-token choice from one position's logits, with transformers' semantics for each knob."""

from __future__ import annotations

import torch

from common.events import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.generator = None
        if params.seed is not None:
            # Same seed, same device: same tokens (the generator lives where the logits are).
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor, history: torch.Tensor | list[int]) -> int:
        p = self.params
        logits = logits.reshape(-1).float()  # [V]
        if p.repetition_penalty != 1 and len(history) > 0:
            seen = torch.as_tensor(history, device=logits.device).reshape(-1).unique()
            scores = logits[seen]
            # As in transformers: shrink positive logits, push negative ones further down.
            logits = logits.index_put(
                (seen,), torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
            )
        if p.greedy:
            return int(logits.argmax())
        logits = logits / p.temperature
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            # Keep the smallest set of most likely tokens whose probability reaches top_p.
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = sorted_logits.softmax(-1)
            before = probs.cumsum(-1) - probs  # probability mass strictly above each token
            drop = before >= p.top_p
            drop[0] = False
            logits = logits.index_put((order[drop],), torch.tensor(float("-inf"), device=logits.device))
        return self.draw(logits.softmax(-1))

    def draw(self, probs: torch.Tensor) -> int:
        """Inverse-CDF sampling with one uniform per token: the token whose cumulative-probability interval holds
        u. One uniform per emitted token whatever else happens is what lets speculative decoding (speculative.py)
        reach, from the same seed, the very tokens plain decoding would."""
        u = torch.rand((), generator=self.generator, device=probs.device)
        cdf = probs.cumsum(-1)  # [V]; a zero-probability token has an empty interval and is never drawn
        token = int(torch.searchsorted(cdf, u[None], right=True))
        if token >= probs.numel():  # u past a cdf that rounding left just under 1: the last possible token
            token = int(probs.nonzero()[-1])
        return token
