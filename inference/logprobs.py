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

from inference.model import KVCache, Transformer


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
        """A special token (a BOS, an end token) is marked: a reply's or an echo's text leaves it out; so is a
        byte-fallback token, whose decoder shows a byte that ends no character as a U+FFFD of its own."""
        text, raw = self.name(token_id)
        entry = {"id": token_id, "token": text, "bytes": raw, "logprob": logprob}
        if token_id in self._special:
            entry["special"] = True
        elif token_id in self._byte_fallback:
            entry["byte_fallback"] = True
        return entry


def _uses_byte_level(tok) -> bool:
    return "ByteLevel" in json.dumps(json.loads(tok.to_str()).get("decoder") or {})


def rows_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """logits: [R, V] head outputs (V: the ids the tokenizer has), tokens: [R] the one chosen at each row -> per
    row (the chosen token's logprob, the `top` most likely (id, logprob), most likely first). Float32: bf16
    logits would round the values."""
    logprobs = logits.float().log_softmax(-1)  # [R, V]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()  # [R]
    if top <= 0:
        return [(value, []) for value in chosen]
    values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # [R, top] each
    alternatives = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return list(zip(chosen, alternatives, strict=True))


def step_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """logits: [V] one step's head output -> rows_logprobs' pair for the chosen `token`."""
    return rows_logprobs(logits[None], torch.tensor([token], device=logits.device), top)[0]


def delta_entry(names: TokenNames, token: int, chosen: float, top: list[tuple[int, float]]) -> dict:
    return {**names.entry(token, chosen), "top": [names.entry(i, lp) for i, lp in top]}


@torch.inference_mode()
def prompt_logprobs(model: Transformer, ids: list[int], top: int, vocab: int, rows: int = 256) -> list[tuple]:
    """Each prompt token after the first: (its logprob given the tokens before it, the `top` most likely
    [(id, logprob)] there), len(ids) - 1 of them, as rows_logprobs gives a generated token's. One forward over
    the prompt into a cache of its own, `rows` positions at a time (logits [rows, vocab] at most at once)."""
    device, dtype = model.tok_embeddings.device, model.tok_embeddings.dtype
    cache = KVCache(model.cfg, len(ids), 1, device, dtype)
    tokens = torch.tensor([ids], device=device)  # [1, T]
    out: list[tuple] = []
    for start in range(0, len(ids) - 1, rows):
        stop = min(start + rows, len(ids) - 1)
        logits = model(tokens[:, start:stop], start, cache)[0, :, :vocab]  # [R, V]: what follows each row
        out += rows_logprobs(logits, tokens[0, start + 1 : stop + 1], top)
    return out


def prompt_entries(names: TokenNames, ids: list[int], scored: list[tuple]) -> list[dict]:
    """A prompt's entries in the shape of a generated token's (delta_entry), the first without a logprob
    (nothing precedes it)."""
    entries = [{**names.entry(ids[0], None), "top": []}]
    return entries + [delta_entry(names, token, *lp) for token, lp in zip(ids[1:], scored, strict=True)]
