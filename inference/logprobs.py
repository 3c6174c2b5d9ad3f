"""Log-probabilities of the tokens a generation picks, and of the most likely others, as an API returns them.

The values are the model's own distribution at each step: log_softmax of the whole head's logits (every id
the tokenizer has), before temperature, top-k, top-p or the repetition penalty reshape it, as vLLM reports
them by default. A token is named by its text and its bytes: a byte-level BPE token may hold part of a
character, which only its bytes spell exactly.
"""

from __future__ import annotations

import functools
import json

import torch


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as in a vocabulary -> the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenNames:
    """A tokenizer's token id -> (text, bytes), cached."""

    def __init__(self, tokenizer):
        self._tok = tokenizer._tok
        self._byte_fallback = tokenizer.byte_fallback_ids
        self._special = tokenizer.special_ids
        self._byte_level = _uses_byte_level(self._tok)  # GPT-2's alphabet, else SentencePiece's "▁"

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one per engine, kept as long as the engine
    def name(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._tok.id_to_token(token_id) or ""
        if token_id in self._special:
            raw = piece.encode()
        elif token_id in self._byte_fallback:
            raw = bytes([int(piece[3:5], 16)])
        elif self._byte_level:
            chars = _byte_level_chars()
            raw = bytes(chars[c] for c in piece if c in chars)
        else:
            raw = piece.replace("▁", " ").encode()
        return raw.decode("utf-8", errors="replace"), list(raw)

    def entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self.name(token_id)
        return {"id": token_id, "token": text, "bytes": raw, "logprob": logprob}


def _uses_byte_level(tok) -> bool:
    return "ByteLevel" in json.dumps(json.loads(tok.to_str()).get("decoder") or {})


def step_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """logits: [V] one step's head output (V: the ids the tokenizer has) -> (the chosen token's logprob, the
    `top` most likely (id, logprob), most likely first). Float32: bf16 logits would round the values."""
    logprobs = logits.float().log_softmax(-1)
    chosen = float(logprobs[token])
    if top <= 0:
        return chosen, []
    values, ids = logprobs.topk(min(top, logprobs.numel()))
    return chosen, list(zip(ids.tolist(), values.tolist(), strict=True))


def delta_entry(names: TokenNames, token: int, chosen: float, top: list[tuple[int, float]]) -> dict:
    return {**names.entry(token, chosen), "top": [names.entry(i, lp) for i, lp in top]}
