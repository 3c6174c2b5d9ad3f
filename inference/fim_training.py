"""Fill-in-the-middle: how training text is rearranged so that a causal model learns to infill.

A piece of a file is cut at two points into prefix, middle and suffix, and written as

    PSM: <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|> middle <|endoftext|>
    SPM: <|fim_prefix|> <|fim_suffix|> suffix <|fim_middle|> prefix middle <|endoftext|>

(SPM as StarCoder writes it: the prefix follows the middle marker, so the middle continues it
directly.) At inference the prompt is the PSM form up to and including <|fim_middle|>
(`psm_prompt`); the model writes the middle and ends it with <|endoftext|>.

Files are first cut at line boundaries into pieces short enough for a FIM example to fit the
context; each piece independently becomes a FIM example with probability `rate`, half of those in
SPM order. The cut points are line boundaries half of the time (whole lines missing, as an editor's
infill request usually is) and any character otherwise. All randomness comes from a generator
seeded by the file's key and the seed, so the result does not depend on the order files come in.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

import numpy as np

EOS = "<|endoftext|>"
FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"
SPECIAL_TOKENS = [EOS, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX]  # ids 0-3, in this order

# One segment of a document: text to tokenize, or a special token (its name) to put in as one id.
Segment = tuple[str, bool]  # (text or token, is_special)


def psm_prompt(prefix: str, suffix: str) -> str:
    """The prompt that asks for the code between `prefix` and `suffix`."""
    return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"


def pieces(text: str, max_chars: int) -> list[str]:
    """`text` cut at line ends into consecutive pieces of at most max_chars (a longer line stays
    whole, alone in its piece); joined, they give `text` back."""
    out: list[str] = []
    current = ""
    for line in text.splitlines(keepends=True):
        if current and len(current) + len(line) > max_chars:
            out.append(current)
            current = ""
        current += line
    if current:
        out.append(current)
    return out


def cut_points(piece: str, rng: random.Random) -> tuple[int, int]:
    """Two sorted cut points: line starts (0 and the end included) half of the time, else characters."""
    if rng.random() < 0.5:
        starts = [0] + [i + 1 for i, c in enumerate(piece) if c == "\n"]
        if starts[-1] != len(piece):
            starts.append(len(piece))
        a, b = rng.choice(starts), rng.choice(starts)
    else:
        a, b = rng.randint(0, len(piece)), rng.randint(0, len(piece))
    return min(a, b), max(a, b)


def fim_segments(piece: str, rng: random.Random, spm_rate: float = 0.5) -> list[Segment]:
    a, b = cut_points(piece, rng)
    prefix, middle, suffix = piece[:a], piece[a:b], piece[b:]
    if rng.random() < spm_rate:
        order = [(FIM_PREFIX, True), (FIM_SUFFIX, True), (suffix, False), (FIM_MIDDLE, True), (prefix, False)]
    else:
        order = [(FIM_PREFIX, True), (prefix, False), (FIM_SUFFIX, True), (suffix, False), (FIM_MIDDLE, True)]
    return [*order, (middle, False), (EOS, True)]


def document_segments(key: str, text: str, rate: float, seed: int, max_chars: int) -> Iterator[Segment]:
    """A file as training segments: its pieces in order, each plain or (with probability `rate`) a
    FIM example, and EOS after the file. A FIM example ends with its own EOS, so the plain piece
    after it starts a new document."""
    rng = random.Random(int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big"))
    for piece in pieces(text, max_chars):
        if rate > 0 and rng.random() < rate:
            yield from fim_segments(piece, rng)
        else:
            yield piece, False
    yield EOS, True


def encode_segments(tok, segments: list[Segment]) -> np.ndarray:
    """Token ids [n] int32 of segments: texts tokenized on their own, in one parallel batch (with
    `tok.encode_special_tokens` set, a special token's name written in a source file stays text),
    specials as their one id."""
    texts = [s for s, special in segments if not special]
    encoded = iter(tok.encode_batch(texts, add_special_tokens=False))
    special_ids = {name: np.array([tok.token_to_id(name)], dtype=np.int32) for name in SPECIAL_TOKENS}
    parts = [
        special_ids[s] if special else np.asarray(next(encoded).ids, dtype=np.int32)
        for s, special in segments
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
