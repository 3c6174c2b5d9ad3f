"""Fill-in-the-middle: the code before and after a cursor in, the middle out, with the FIM tokens a
checkpoint's tokenizer carries.

Three spellings are in use, each with the order its model was trained on (prefix, suffix, then the middle):
- StarCoder and Qwen2.5-Coder: `<fim_prefix>` / `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`;
- CodeLlama: `▁<PRE>`, `▁<SUF>`, `▁<MID>`, and `▁<EOT>` ending the middle;
- DeepSeek-Coder: `<｜fim▁begin｜>` prefix `<｜fim▁hole｜>` suffix `<｜fim▁end｜>`.
The prefix and the suffix are text: a FIM token's spelling inside the code is its characters, never the token
(Tokenizer._encode_segment), so code that mentions `<|fim_middle|>` cannot reorder the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.events import InvalidRequest, unicode_text

# (prefix, suffix, middle, further tokens that end a middle), each family's spellings
FIM_FAMILIES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>")),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<fim_pad>", "<file_sep>", "<filename>")),
    ("▁<PRE>", "▁<SUF>", "▁<MID>", ("▁<EOT>",)),
    ("<PRE>", "<SUF>", "<MID>", ("<EOT>",)),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", ()),
)


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    stop_ids: frozenset[int]  # besides the model's end tokens: what ends a middle (CodeLlama's <EOT>)
    spelling: tuple[str, str, str]

    def prompt_ids(self, tokenizer, prefix: str, suffix: str) -> list[int]:
        """[BOS] <prefix> prefix-text <suffix> suffix-text <middle>: the model writes the middle next."""
        unicode_text(prefix, "prompt")
        unicode_text(suffix, "suffix")
        ids = [tokenizer.bos_id] if tokenizer.add_bos else []
        ids.append(self.prefix)
        ids += tokenizer._encode_segment(prefix, first=False)
        ids.append(self.suffix)
        ids += tokenizer._encode_segment(suffix, first=False)
        ids.append(self.middle)
        return ids


def find_fim_tokens(tokenizer) -> FimTokens | None:
    """The first family whose three tokens the tokenizer has, as single tokens; None when it has none."""
    for prefix, suffix, middle, enders in FIM_FAMILIES:
        ids = [tokenizer._tok.token_to_id(text) for text in (prefix, suffix, middle)]
        if None in ids:
            continue
        stops = {tokenizer._tok.token_to_id(text) for text in enders} - {None}
        return FimTokens(*ids, stop_ids=frozenset(stops), spelling=(prefix, suffix, middle))
    return None


def no_fim_error(model: str) -> InvalidRequest:
    return InvalidRequest(
        "suffix",
        f"the model {model!r} has no fill-in-the-middle tokens in its tokenizer (none of "
        "<|fim_prefix|>, <fim_prefix>, <PRE>, <｜fim▁begin｜>), so it cannot complete between a prefix and a suffix",
        code="fim_not_supported",
    )
