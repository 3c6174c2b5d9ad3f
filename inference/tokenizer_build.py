"""Train BPE tokenizers and write them in the Hugging Face on-disk format.

Two styles, matching the two families of real checkpoints:
- "bytelevel": byte-level BPE as Qwen2 and Llama 3 (and DeepSeek-Coder) ship it: every byte is a symbol.
- "sentencepiece": Llama-2 style (Laneformer): spaces become "▁", a BOS is prepended, and characters
  outside the vocabulary fall back to the 256 byte tokens <0x00>..<0xFF>.

Used by `inference.synth` (random-weight checkpoints with a real tokenizer) and `inference.train`.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Literal

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

Style = Literal["bytelevel", "sentencepiece"]

# Our own chat templates (jinja2, the variables transformers passes: messages, bos_token, eos_token,
# add_generation_prompt, raise_exception).
CHAT_TEMPLATES: dict[str, str] = {
    # Qwen-style ChatML; the turn ends with <|im_end|>, which must be a stop token.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Llama-3 style headers; the turn ends with <|eot_id|>.
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}"
        "{{ '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    # Llama-2 [INST] turns: needs no extra special tokens, so it suits SentencePiece vocabularies.
    "llama2": (
        "{% if messages and messages[0]['role'] == 'system' %}"
        "{% set system = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
        "{% set messages = messages[1:] %}"
        "{% else %}{% set system = '' %}{% endif %}"
        "{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant/user/...') }}"
        "{% endif %}"
        "{% if message['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' + (system if loop.first else '') + message['content'] | trim + ' [/INST]' }}"
        "{% else %}{{ ' ' + message['content'] | trim + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    # For a base model trained on plain Python: the request becomes a comment and the answer is code.
    # A base code model: a request in words becomes `# ` comment lines the model continues with code,
    # while a user message that already is code (a `def` line and its docstring, say) goes in as is.
    "pycomment": (
        "{% for message in messages %}{% set text = message['content'] %}"
        "{% if message['role'] == 'assistant' %}{{ text + '\\n' }}"
        "{% elif message['role'] == 'user' and text.lstrip().startswith("
        "('def ', 'async def ', 'class ', 'import ', 'from ', '@', '#')) %}"
        "{{ text if text.endswith('\\n') else text + '\\n' }}"
        "{% else %}{% for line in text.strip().split('\\n') %}"
        "{{ ('# ' + line).rstrip() + '\\n' }}"
        "{% endfor %}{% endif %}"
        "{% endfor %}"
    ),
}
CHAT_TEMPLATES["laneformer"] = CHAT_TEMPLATES["llama2"]


def continues_code(chat_template: str | None) -> bool:
    """Whether a checkpoint is a base model, which continues what it is given (no chat template, or the
    comment template of a base code model) rather than answers requests: the page invites code for it."""
    return chat_template is None or chat_template == CHAT_TEMPLATES["pycomment"]


SPIECE_UNDERLINE = "▁"
# The pre-tokenizer regex of Llama 3 (numbers in groups of up to 3; Qwen2's splits every digit). Unlike
# GPT-2's, it keeps a newline apart from the next line's indentation ("\n", "   ", " return"), so a prompt
# that ends with "\n" is cut into the same tokens as the training text was, and the model continues the
# next line instead of assuming column 0.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def train_bpe(texts: Iterable[str], vocab_size: int, style: Style, special_tokens: list[str]) -> Tokenizer:
    """Train a BPE tokenizer. Special tokens take the first ids, in the order given; for the
    sentencepiece style the 256 byte-fallback tokens follow them (as in Llama-2: <unk>, <s>, </s>,
    <0x00>, ...), and the first special token is the unknown token."""
    if style == "bytelevel":
        tok = Tokenizer(models.BPE())
        # Llama 3 style: split with SPLIT_PATTERN first, then map bytes to symbols.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=special_tokens,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return _checked_size(tok, vocab_size, style)
    if style == "sentencepiece":
        if not special_tokens:
            raise ValueError("special_tokens: the sentencepiece style needs an unknown token first")
        tok = Tokenizer(models.BPE(unk_token=special_tokens[0], byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_UNDERLINE, prepend_scheme="first")
        trainer = trainers.BpeTrainer(
            vocab_size=max(vocab_size - len(BYTE_TOKENS), len(special_tokens) + 1),
            special_tokens=special_tokens,
            limit_alphabet=200,  # rare characters (emoji, most CJK) go through the byte tokens
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return _checked_size(_with_byte_fallback(tok, len(special_tokens)), vocab_size, style)
    raise ValueError(f"style: must be 'bytelevel' or 'sentencepiece', got {style!r}")


def _checked_size(tok: Tokenizer, vocab_size: int, style: Style) -> Tokenizer:
    # The trainer keeps the whole initial alphabet even past vocab_size; a model could not embed that.
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size: {vocab_size} is below the {style} minimum of {tok.get_vocab_size()}")
    return tok


def _with_byte_fallback(tok: Tokenizer, num_special: int) -> Tokenizer:
    """Insert <0x00>..<0xFF> into the model vocabulary right after the special tokens, and give the
    tokenizer Llama-2's decoder (▁ -> space, bytes fused back into UTF-8, the prepended space stripped)."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]  # token -> id
    ordered = sorted(vocab, key=vocab.get)
    ordered = ordered[:num_special] + BYTE_TOKENS + [t for t in ordered[num_special:] if t not in BYTE_TOKENS]
    spec["model"]["vocab"] = {t: i for i, t in enumerate(ordered)}
    for added in spec["added_tokens"]:
        added["id"] = spec["model"]["vocab"][added["content"]]
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": SPIECE_UNDERLINE}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return Tokenizer.from_str(json.dumps(spec))


def write_tokenizer_files(
    out_dir: Path,
    tok: Tokenizer,
    *,
    style: Style,
    bos: str | None,
    eos: str,
    chat_template: str | None,
    extra_special: Iterable[str] = (),
    unk: str | None = None,
    model_max_length: int = 4096,
) -> None:
    """Write tokenizer.json and tokenizer_config.json as transformers' fast tokenizers do.

    BOS is prepended by our Tokenizer (and by transformers) when `add_bos_token` is true, which we
    set whenever a BOS token is given. `extra_special` names further special tokens (chat markers)
    that must already be in the vocabulary."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    named = [t for t in (unk, bos, eos, *extra_special) if t is not None]
    missing = [t for t in named if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"special tokens not in the vocabulary: {missing}")
    if bos is not None:
        # As Llama's tokenizer.json: the post-processor prepends BOS (transformers 5 reads only this).
        tok = Tokenizer.from_str(tok.to_str())
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    tok.save(str(out_dir / "tokenizer.json"))

    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in dict.fromkeys(named)
    }
    config = {
        "tokenizer_class": "LlamaTokenizerFast" if style == "sentencepiece" else "PreTrainedTokenizerFast",
        "add_bos_token": bos is not None,
        "add_eos_token": False,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": None,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(extra_special),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if style == "sentencepiece":
        config["legacy"] = False
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# A small fixed corpus for synthetic checkpoints: a few standard-library modules (present everywhere)
# plus text outside ASCII, so that byte fallback and multi-byte characters are exercised.
_SYNTH_MODULES = (
    "textwrap.py",
    "string.py",
    "heapq.py",
    "bisect.py",
    "fnmatch.py",
    "shlex.py",
    "json/decoder.py",
)
_SYNTH_PROSE = (
    "The quick brown fox jumps over the lazy dog. Ünïcödé façade, naïve café. "
    "日本語のテキストと中文文本。 Ελληνικά κείμενα. Русский текст. "
)


def _synthetic_corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8", errors="replace") for name in _SYNTH_MODULES]
    return texts + [_SYNTH_PROSE] * 20


@lru_cache(maxsize=8)
def _synthetic_json(style: Style, vocab_size: int) -> str:
    specials = _default_specials(style)
    return train_bpe(_synthetic_corpus(), vocab_size, style, specials).to_str()


def synthetic_tokenizer(style: Style, vocab_size: int) -> Tokenizer:
    """A small deterministic tokenizer for random-weight checkpoints. Its vocabulary stops growing
    when the corpus runs out of merges (a few thousand), below a large model's `vocab_size`, as
    real checkpoints whose embeddings are padded past the tokenizer."""
    return Tokenizer.from_str(_synthetic_json(style, vocab_size))


def _default_specials(style: Style) -> list[str]:
    if style == "sentencepiece":
        return ["<unk>", "<s>", "</s>"]
    # Qwen's three plus Llama 3's; a checkpoint's chat template picks the ones it uses.
    return [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]


# The special tokens of each chat format, as the real checkpoints of that family name them:
# style, BOS, the stop tokens (the first is tokenizer_config's eos_token), further special tokens.
CHAT_FORMATS: dict[str, tuple[Style, str | None, tuple[str, ...], tuple[str, ...]]] = {
    "chatml": (
        "bytelevel",
        None,
        ("<|im_end|>", "<|endoftext|>"),
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    ),
    "llama3": (
        "bytelevel",
        "<|begin_of_text|>",
        ("<|eot_id|>", "<|end_of_text|>"),
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"),
    ),
    "llama2": ("sentencepiece", "<s>", ("</s>",), ()),
    "laneformer": ("sentencepiece", "<s>", ("</s>",), ()),
}


def write_synthetic_tokenizer(out_dir: Path, chat_format: str, vocab_size: int) -> dict:
    """Write the tokenizer files of a synthetic checkpoint in `chat_format`'s conventions and return
    the ids for config.json / generation_config.json: {"bos_token_id": int | None, "eos_token_id": [int]}."""
    style, bos, stops, extra = CHAT_FORMATS[chat_format]
    tok = synthetic_tokenizer(style, vocab_size)
    unk = "<unk>" if style == "sentencepiece" else None
    write_tokenizer_files(
        out_dir,
        tok,
        style=style,
        bos=bos,
        eos=stops[0],
        unk=unk,
        chat_template=CHAT_TEMPLATES[chat_format],
        extra_special=[t for t in extra if t != stops[0]],
    )
    return {
        "bos_token_id": None if bos is None else tok.token_to_id(bos),
        "eos_token_id": [tok.token_to_id(t) for t in stops],
    }
