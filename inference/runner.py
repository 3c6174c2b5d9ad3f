"""The reference runner: prefill and one-token decode with the plain PyTorch model and the Sampler.

The Engine talks to a runner through three members (the fast CUDA runner in inference/fast/ has the
same): `generate_tokens(prompt_ids, params, stop_ids, start, prediction)` yields token ids, the first right
after prefill, and ends after a stop id or `params.max_new_tokens` tokens (`prediction`: tokens the reply is
expected to repeat, drafted from as the context is); `last_prefill_ms` is the
time that first token took; `cache` is the KV cache it reads and writes in place. With `start` > 0
the cache's rows [0, start) already hold the prompt's first ids (inference/prefix_cache.py) and only
the rest is prefilled. The caller may close the iterator at any point. `counts` (a
speculative.SpeculationCounts) says how many model steps, draft tokens and accepted drafts the
current generation has had so far.

Speculative decoding (speculative.py): when the context has a suffix to copy, one step runs the last
token and up to k drafted tokens as k+1 positions of the model's multi-position forward, from the cache.
The cache is written at all k+1 positions; those past the accepted ones are simply overwritten by the
next step, and no step reads a cached position beyond its own last one, so a rejection needs no undo
(and the rows a kept prefix claims afterwards are all of accepted tokens).

With `params.logprobs` set, `last_logprobs` holds the token just yielded's (logprob, [(id, logprob)] of the
most likely), computed from the whole head (inference/logprobs.py); the Engine reads it between tokens, so
such a request decodes one token a step (no drafts).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial

import torch

from common.events import SamplingParams
from inference.logprobs import step_logprobs
from inference.model import KVCache, Transformer
from inference.prefix_cache import check_prompt_span
from inference.sampling import Sampler
from inference.speculative import (
    DraftLength,
    SpeculationCounts,
    SpeculationSettings,
    StepClock,
    SuffixDrafter,
    accept,
)


class ReferenceRunner:
    serves_logprobs = True  # every step's whole logits are at hand (the Engine sends logprobs requests here)

    def __init__(
        self,
        model: Transformer,
        max_context: int,
        vocab_limit: int | None = None,
        speculation: SpeculationSettings | None = None,
    ):
        cfg = model.cfg
        device, dtype = model.tok_embeddings.device, model.tok_embeddings.dtype
        self.model, self.max_context, self.device = model, max_context, device
        # Ids past the tokenizer's vocabulary (padded embedding rows) are never sampled: nothing decodes them.
        self.vocab_limit = min(vocab_limit or cfg.vocab_size, cfg.vocab_size)
        self.cache = KVCache(cfg, max_context, 1, device, dtype)  # allocated once, reused by every request
        self.next_input = torch.zeros(1, 1, dtype=torch.long, device=device)  # the decode step's input
        self.last_prefill_ms = 0.0
        self.speculation = SpeculationSettings.from_env() if speculation is None else speculation
        self.counts = SpeculationCounts()
        self.last_logprobs: tuple[float, list[tuple[int, float]]] | None = None

    @torch.inference_mode()
    def generate_tokens(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        start: int = 0,
        prediction: tuple[int, ...] = (),
    ) -> Iterator[int]:
        n = len(prompt_ids)
        check_prompt_span(n, start, self.max_context)
        budget = min(params.max_new_tokens, self.max_context - n)
        sample = Sampler(params, self.device)
        history = list(prompt_ids)  # for the repetition penalty

        began = time.perf_counter()
        prompt = torch.tensor([prompt_ids[start:]], dtype=torch.long, device=self.device)
        logits = self.model(prompt, start, self.cache, last_only=True)[0, -1, : self.vocab_limit]
        token = sample(logits, history)  # reading the id waits for the device
        self.last_prefill_ms = (time.perf_counter() - began) * 1e3
        self._keep_logprobs(logits, token, params)

        self.counts = counts = SpeculationCounts()
        speculates = self.speculation.enabled and params.logprobs is None
        drafter = SuffixDrafter(prompt_ids, prediction) if speculates else None
        draft_length, clock = DraftLength(self.speculation.max_draft), StepClock()
        pos, made = n, 0  # the position of `token` (not yet in the cache); tokens yielded so far
        while True:
            yield token
            made += 1
            if token in stop_ids or made == budget:
                return
            history.append(token)
            # k drafted tokens may yield k+1, within the budget
            k = 0
            if drafter is not None:
                drafter.extend([token])
                k = min(draft_length.next(), budget - made - 1)
            draft = drafter.draft(k) if k else []
            counts.decode_steps += 1
            step_start = time.perf_counter()
            if not draft:  # the plain step
                self.next_input.fill_(token)
                logits = self.model(self.next_input, pos, self.cache, last_only=True)
                logits = logits[0, -1, : self.vocab_limit]
                token, pos = sample(logits, history), pos + 1  # waits for the device
                self._keep_logprobs(logits, token, params)
                if drafter is not None:
                    clock.plain(time.perf_counter() - step_start)
                continue
            inputs = torch.tensor([[token, *draft]], dtype=torch.long, device=self.device)
            logits = self.model(inputs, pos, self.cache)[0, :, : self.vocab_limit]  # [k+1, V]
            emitted = accept(draft, partial(_sample_appending, sample, logits, history), stop_ids)
            del history[-len(emitted) :]  # the loop above appends each token as it is yielded
            last = len(emitted) - 1  # emitted[last] is the model's own choice, unless an accepted stop id
            accepted = last + int(last < len(draft) and emitted[last] == draft[last])
            counts.add(drafter, len(draft), accepted)
            draft_length.update(len(draft), accepted, clock.cost(time.perf_counter() - step_start))
            for extra in emitted[:-1]:
                yield extra
                made += 1
                history.append(extra)
                drafter.extend([extra])
            token, pos = emitted[-1], pos + len(emitted)

    def _keep_logprobs(self, logits: torch.Tensor, token: int, params: SamplingParams) -> None:
        """logits: [vocab_limit], the step's raw head output."""
        if params.logprobs is not None:
            self.last_logprobs = step_logprobs(logits, token, params.logprobs)


def _sample_appending(sample: Sampler, logits: torch.Tensor, history: list[int], j: int) -> int:
    """Position j's token of a verify step's logits [k+1, V]; it joins the history the next position sees."""
    chosen = sample(logits[j], history)
    history.append(chosen)
    return chosen
