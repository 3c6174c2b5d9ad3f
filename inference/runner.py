"""The reference runner: prefill and one-token decode with the plain PyTorch model and the Sampler.

The Engine talks to a runner through two members (the fast CUDA runner in inference/fast/ has the
same): `generate_tokens(prompt_ids, params, stop_ids)` yields token ids, the first right after
prefill, and ends after a stop id or `params.max_new_tokens` tokens; `last_prefill_ms` is the
time that first token took. The caller may close the iterator at any point. With `params.logprobs` set,
`last_logprobs` holds the token just yielded's (logprob, [(id, logprob)] of the most likely), computed
from the whole head (inference/logprobs.py); the Engine reads it between tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from inference.events import SamplingParams
from inference.logprobs import step_logprobs
from inference.model import KVCache, Transformer
from inference.sampling import Sampler


class ReferenceRunner:
    def __init__(self, model: Transformer, max_context: int, vocab_limit: int | None = None):
        cfg = model.cfg
        device, dtype = model.tok_embeddings.device, model.tok_embeddings.dtype
        self.model, self.max_context, self.device = model, max_context, device
        # Ids past the tokenizer's vocabulary (padded embedding rows) are never sampled: nothing decodes them.
        self.vocab_limit = min(vocab_limit or cfg.vocab_size, cfg.vocab_size)
        self.cache = KVCache(cfg, max_context, 1, device, dtype)  # allocated once, reused by every request
        self.next_input = torch.zeros(1, 1, dtype=torch.long, device=device)  # the decode step's input
        self.last_prefill_ms = 0.0
        self.last_logprobs: tuple[float, list[tuple[int, float]]] | None = None

    @torch.inference_mode()
    def generate_tokens(
        self, prompt_ids: list[int], params: SamplingParams, stop_ids: frozenset[int] = frozenset()
    ) -> Iterator[int]:
        n = len(prompt_ids)
        if not 0 < n < self.max_context:
            raise ValueError(f"prompt_ids: length must be in [1, {self.max_context - 1}], got {n}")
        budget = min(params.max_new_tokens, self.max_context - n)
        sample = Sampler(params, self.device)
        history = list(prompt_ids)  # for the repetition penalty

        start = time.perf_counter()
        prompt = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        logits = self.model(prompt, 0, self.cache, last_only=True)[0, -1, : self.vocab_limit]
        token = sample(logits, history)  # reading the id waits for the device
        self.last_prefill_ms = (time.perf_counter() - start) * 1e3
        self._keep_logprobs(logits, token, params)

        for pos in range(n, n + budget):
            yield token
            if token in stop_ids or pos == n + budget - 1:
                return
            history.append(token)
            self.next_input.fill_(token)
            logits = self.model(self.next_input, pos, self.cache, last_only=True)[0, -1, : self.vocab_limit]
            token = sample(logits, history)
            self._keep_logprobs(logits, token, params)

    def _keep_logprobs(self, logits: torch.Tensor, token: int, params: SamplingParams) -> None:
        """logits: [vocab_limit], the step's raw head output."""
        if params.logprobs is not None:
            self.last_logprobs = step_logprobs(logits, token, params.logprobs)
