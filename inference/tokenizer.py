"""A checkpoint's tokenizer: tokenizer.json through the `tokenizers` library, the chat template of
tokenizer_config.json rendered with jinja2, and special ids read the way transformers reads them.

What a person or a client writes is text, never control: `encode_text` and `encode_chat` read the
spelling of a special token inside a prompt or a message ("<|endoftext|>" in a line of code,
"<|im_end|>\n<|im_start|>system" pasted into a message) as the characters it is made of, where
`tokenizers` (and so transformers and most servers) would turn it into the token itself: a prompt that
ends the generation at once, or a forged system turn. Only the chat template's own markers are tokens.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from inference.checkpoint import CheckpointError
from inference.events import InvalidRequest

# The special tokens a template may name, as tokenizer_config.json (or special_tokens_map.json) spells them
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(self, tok: HFTokenizer, config: dict, bos_id: int | None, eos_ids: frozenset[int]):
        self._tok = tok
        # The same tokenizer with special tokens' spellings encoded as text (a second instance: the flag is
        # the tokenizer's own state, and a shared one would race between threads).
        self._plain = HFTokenizer.from_str(tok.to_str())
        self._plain.encode_special_tokens = True
        specials = sorted(
            {t.content for t in tok.get_added_tokens_decoder().values() if t.special and t.content}, key=len
        )
        # The spellings of the special tokens, longest first (so "<|im_end|>x" is not cut at a shorter one)
        self._special_spelling = (
            re.compile("|".join(map(re.escape, reversed(specials)))) if specials else None
        )
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        # Ids may leave gaps (added tokens placed past the base vocabulary): the largest one bounds the model.
        self.max_id = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds(tok, bos_id)
        self.add_bos = bool(add_bos) and bos_id is not None
        # Templates see the token text tokenizer_config.json names, as in transformers: none when it names none,
        # even where config.json gives a bos_token_id (Qwen's <|endoftext|>, which its prompts never start with).
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        # The other special tokens transformers hands a template (its special_tokens_map)
        self.template_tokens = {
            key: text for key in ("unk_token", "pad_token") if (text := _token_text(config.get(key)))
        }
        template = config.get("chat_template")
        if isinstance(template, list):  # a list of named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.has_chat_template = template is not None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointError(f"{tok_file}: missing (only tokenizer.json checkpoints are supported)")
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust parser's errors are one-line already
            raise CheckpointError(f"{tok_file}: cannot be parsed: {e}") from None
        config = _read_json(path / "tokenizer_config.json")
        # The legacy layout (a tokenizer_config.json without added_tokens_decoder) names the special tokens in
        # special_tokens_map.json, whose names then win, as transformers reads them; later exports ignore it.
        if "added_tokens_decoder" not in config:
            special_map = _read_json(path / "special_tokens_map.json")
            config.update({key: value for key, value in special_map.items() if key in SPECIAL_TOKEN_KEYS})
        # transformers >= 4.50 saves the template as chat_template.jinja (no longer in tokenizer_config.json);
        # where both exist, the file wins, as in transformers.
        template_file = path / "chat_template.jinja"
        template_source = path / "tokenizer_config.json"
        if template_file.is_file():
            try:
                config["chat_template"] = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{template_file}: cannot be read ({e})") from None
            template_source = template_file
        model_config = _read_json(path / "config.json")
        generation = _read_json(path / "generation_config.json")

        def special(key: str) -> list[int]:
            # generation_config.json wins over config.json, which wins over tokenizer_config.json
            for name, source in (("generation_config.json", generation), ("config.json", model_config)):
                value = source.get(f"{key}_token_id")
                if value is not None:
                    ids = value if isinstance(value, list) else [value]
                    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                        raise CheckpointError(f"{path / name}: {key}_token_id must be an id or a list of ids")
                    return ids
            token_id = tok.token_to_id(_token_text(config.get(f"{key}_token")) or "")
            return [] if token_id is None else [token_id]

        bos = special("bos")
        tokenizer = cls(tok, config, bos[0] if bos else None, frozenset(special("eos")))
        if tokenizer.chat_template is not None:
            # A template that cannot compile fails here, naming the file, not in every chat request later.
            try:
                _compile(tokenizer.chat_template)
            except TemplateError as e:
                raise CheckpointError(f"{template_source}: the chat template does not compile: {e}") from None
        return tokenizer

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        # A rendered chat template may already start with BOS: never add a second one.
        if add_special and self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """A prompt's tokens, BOS first where the model takes one: every character of it as text."""
        ids = self._plain.encode(text, add_special_tokens=False).ids
        if self.add_bos:
            ids.insert(0, self.bos_id)
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The rendered chat template's tokens (its own BOS included), the messages' contents as text."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        literal = [i for i, m in enumerate(messages) if self._has_special_spelling(m["content"])]
        if not literal:  # the common case: nothing in the contents could be read as a token
            return self.encode(text, add_special=False)
        # The rendered text in pieces: the spellings in those contents through the plain tokenizer, the rest
        # (the template's markers among it) through the usual one.
        ids = []
        start = 0
        for span_start, span_end in self._content_spans(messages, literal, text, add_generation_prompt):
            for found in self._special_spelling.finditer(text, span_start, span_end):
                ids += _encode_piece(self._tok, text[start : found.start()], first=start == 0)
                ids += _encode_piece(self._plain, found.group(), first=False)
                start = found.end()
        return ids + _encode_piece(self._tok, text[start:], first=False)

    def _has_special_spelling(self, content: str) -> bool:
        return self._special_spelling is not None and self._special_spelling.search(content) is not None

    def _content_spans(
        self, messages: list[dict], literal: list[int], text: str, add_generation_prompt: bool
    ) -> list[tuple[int, int]]:
        """Where the contents of messages `literal` sit in the rendered `text`, in order: found by rendering
        again with a marker of this call in their place (a template may write the same words itself)."""
        nonce = secrets.token_hex(8)
        marked = [
            dict(m, content=f"\ue000{nonce}:{i}\ue001") if i in literal else m for i, m in enumerate(messages)
        ]
        rendered = self.apply_chat_template(marked, add_generation_prompt)
        markers = list(re.finditer(f"\ue000{nonce}:(\\d+)\ue001", rendered))
        if [int(m.group(1)) for m in markers] == literal:
            # Templates copy a content as is, or trimmed (Llama 3's `| trim`)
            for copy in (str, str.strip):
                parts, spans, start, length = [], [], 0, 0
                for marker in markers:
                    content = copy(messages[int(marker.group(1))]["content"])
                    parts += [rendered[start : marker.start()], content]
                    length += marker.start() - start
                    spans.append((length, length + len(content)))
                    length += len(content)
                    start = marker.end()
                if "".join(parts) + rendered[start:] == text:
                    return spans
        index = literal[0]
        token = self._special_spelling.search(messages[index]["content"]).group()
        raise InvalidRequest(
            f"messages[{index}].content",
            f"contains {token!r}, the spelling of one of this model's control tokens, in a message its chat "
            "template does not copy as is; remove it from the message",
        )

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise InvalidRequest("messages", "this model has no chat template")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise InvalidRequest("messages", f"message {i} must have a string 'role' and 'content'")
        try:
            return _compile(self.chat_template).render(
                messages=messages,
                # Passed as transformers passes them: templates test `tools is not none` without `is defined`.
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **self.template_tokens,
            )
        except TemplateError as e:
            raise InvalidRequest("messages", f"chat template: {e}") from None

    def stream_decoder(self, context_ids: Sequence[int] = ()) -> StreamDecoder:
        """`context_ids`: tokens already shown (the end of the prompt), so that the first new token
        keeps its leading space (SentencePiece strips a space at the start of a decode)."""
        return StreamDecoder(self, context_ids)


class StreamDecoder:
    """Turns a stream of token ids into text deltas.

    Decoding token by token breaks two things: a character spread over several byte tokens
    (decoded alone, each gives U+FFFD) and SentencePiece's "▁word", whose space is stripped at the
    start of a decode. So each push decodes a short window of recent tokens plus the new one and
    emits what grew past the text already emitted, holding back a trailing U+FFFD (an unfinished
    character) until the next token completes it or `flush` gives up on it."""

    WINDOW = 6  # tokens kept before the new ones: more than a 4-byte character needs

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int] = ()):
        self._decode = tokenizer.decode
        self._ids: list[int] = list(context_ids)[-self.WINDOW :]  # the window and the tokens since
        self._emitted = len(self._decode(self._ids))  # chars of decode(self._ids) already emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        ready = len(text.rstrip("\ufffd"))
        delta = text[self._emitted : ready] if ready > self._emitted else ""
        self._emitted = max(self._emitted, ready)
        if ready == len(text) and len(self._ids) > 2 * self.WINDOW:
            # All emitted and complete: slide the window so each push decodes a bounded number of tokens.
            self._ids = self._ids[-self.WINDOW :]
            self._emitted = len(self._decode(self._ids))
        return delta

    def flush(self) -> str:
        """The text held back (an unfinished character, shown as U+FFFD as `decode` would)."""
        text = self._decode(self._ids)
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta


def _encode_piece(tok: HFTokenizer, text: str, first: bool) -> list[int]:
    """`text`'s tokens as they would be in the middle of a longer text: SentencePiece-style tokenizers start
    each call with a word boundary ("▁"), a space the text never had. Encoded after a newline that is then
    dropped, unless the newline merged with the text (the piece is then encoded alone)."""
    if first or not text:
        return tok.encode(text, add_special_tokens=False).ids
    anchor = tok.encode("\n", add_special_tokens=False).ids
    ids = tok.encode("\n" + text, add_special_tokens=False).ids
    if ids[: len(anchor)] == anchor:
        return ids[len(anchor) :]
    return tok.encode(text, add_special_tokens=False).ids


class _GenerationMarks(Extension):
    """`{% generation %} ... {% endgeneration %}` around an assistant's text: templates written for training
    (TRL's assistant-only loss) mark what the model wrote; a prompt renders the contents as they are."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_contents"), [], [], body).set_lineno(lineno)

    def _contents(self, caller):
        return caller()


@lru_cache(maxsize=16)
def _compile(template: str):
    # The environment transformers renders chat templates in, so that real templates behave the same.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationMarks]
    )

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson sorts keys and escapes <, >, & and ' as HTML: not what the model was trained on.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(pattern: str) -> str:
        # Llama 3.x templates write today's date into the system header when they can ask for it.
        return datetime.now().strftime(pattern)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    return env.from_string(template)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _post_processor_adds(tok: HFTokenizer, bos_id: int | None) -> bool:
    """Without `add_bos_token` in tokenizer_config.json, follow tokenizer.json's post-processor:
    Llama's TemplateProcessing starts the single-sequence template with BOS."""
    processor = json.loads(tok.to_str()).get("post_processor") or {}
    processors = (
        processor.get("processors", [processor]) if processor.get("type") == "Sequence" else [processor]
    )
    for p in processors:
        if p.get("type") == "TemplateProcessing" and p.get("single"):
            first = p["single"][0].get("SpecialToken", {}).get("id")
            return first is not None and tok.token_to_id(first) == bos_id
    return False
