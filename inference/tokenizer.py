"""A checkpoint's tokenizer: tokenizer.json through the `tokenizers` library, the chat template of
tokenizer_config.json rendered with jinja2, and special ids read the way transformers reads them.

What a person or a client writes is text, never control: `encode_text` and `encode_chat` read the
spelling of a special token inside a prompt or a message ("<|endoftext|>" in a line of code,
"<|im_end|>\n<|im_start|>system" pasted into a message) as the characters it is made of, where
`tokenizers` (and so transformers and most servers) would turn it into the token itself: a prompt that
ends the generation at once, or a forged system turn. Only the chat template's own markers are tokens.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer as HFTokenizer

from common.chat_template import check_template_kwargs, compile_template, json_strings
from common.events import InvalidRequest
from inference.config import CheckpointError, check_link, read_json_file
from inference.stream_decoder import StreamDecoder

# The special tokens a template may name, as tokenizer_config.json (or special_tokens_map.json) spells them
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# A placeholder for a special token's spelling in a message while the chat template renders it: private-use
# characters, no case, no whitespace, which templates copy as they are (see Tokenizer._render_marked)
_OPEN, _CLOSE = "\ue000", "\ue001"
_DIGIT_BASE, _NONCE_BASE = 0xE010, 0xE100
_BYTE_TOKEN = re.compile("<0x[0-9A-Fa-f]{2}>")
# What a slow tokenizer saves in place of tokenizer.json (files joined by " + " go together)
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json + merges.txt")

log = logging.getLogger(__name__)


class Tokenizer:
    def __init__(
        self, tok: HFTokenizer, config: dict, bos_id: int | None, eos_ids: frozenset[int], source: str = ""
    ):
        """`bos_id`: the bos_token_id of generation_config.json or config.json (`source` names it), else the id
        of tokenizer_config.json's bos_token. Where the tokenizer itself adds a BOS, that one is what a prompt
        starts with, as with transformers' tokenizer, whatever those files say."""
        self._tok = tok
        serialized = tok.to_str()
        spec = json.loads(serialized)
        # The same tokenizer with special tokens' spellings encoded as text (a second instance: the flag is
        # the tokenizer's own state, and a shared one would race between threads), and, where it differs, the
        # one for text that is not at the start of the input (see _encode_segment).
        self._plain = _plain_tokenizer(serialized)
        mid_text = _mid_text_spec(spec)
        self._plain_mid = self._plain if mid_text is None else _plain_tokenizer(json.dumps(mid_text))
        added = tok.get_added_tokens_decoder()
        special_tokens = {i: t for i, t in added.items() if t.special and t.content}
        # The ids decode() skips, and the whitespace each special token takes in with it (lstrip / rstrip)
        self.special_ids = frozenset(special_tokens)
        self._special_strip = {t.content: (t.lstrip, t.rstrip) for t in special_tokens.values()}
        # Byte-fallback tokens ("<0xF0>"), which a SentencePiece decoder turns into text a run at a time
        self.byte_fallback_ids = _byte_fallback_ids(tok, spec)
        specials = sorted({t.content for t in special_tokens.values()}, key=len)
        # The spellings of the special tokens, longest first (so "<|im_end|>x" is not cut at a shorter one)
        self._special_spelling = (
            re.compile("|".join(map(re.escape, reversed(specials)))) if specials else None
        )
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        # Ids may leave gaps (added tokens placed past the base vocabulary): the largest one bounds the model.
        self.max_id = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
        # The BOS the tokenizer adds: its tokenizer.json post-processor's first token (transformers runs that
        # post-processor as it is), else tokenizer_config.json's bos_token; added where add_bos_token says so,
        # else where the post-processor starts with it.
        processor_bos = _post_processor_bos(tok)
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = processor_bos is not None
        own_bos = (
            processor_bos
            if processor_bos is not None
            else tok.token_to_id(_token_text(config.get("bos_token")) or "")
        )
        if add_bos and own_bos is not None and own_bos != bos_id:
            if bos_id is not None:
                log.warning(
                    "%s names BOS id %s, but the tokenizer adds %r (%s): prompts start with the tokenizer's, "
                    "as with transformers' tokenizer",
                    source or "config.json",
                    bos_id,
                    tok.id_to_token(own_bos),
                    own_bos,
                )
            bos_id = own_bos
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos = bool(add_bos) and bos_id is not None
        # Templates see the token text tokenizer_config.json names, as in transformers: none when it names none,
        # even where config.json gives a bos_token_id (Qwen's <|endoftext|>, which its prompts never start with).
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        # What ends a generation: the model's end ids and, as vLLM stops, the tokenizer's own eos_token where
        # generation_config.json or config.json name others
        eos_token_id = tok.token_to_id(self.eos_token) if self.eos_token else None
        self.stop_ids = eos_ids | ({eos_token_id} - {None})
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
        check_link(tok_file)
        if not tok_file.is_file():
            # A slow tokenizer's files alone (SentencePiece's, or a BPE's vocab.json and merges.txt): transformers
            # converts them to the fast tokenizer on load, and save_pretrained writes its tokenizer.json.
            slow = [
                name for name in SLOW_TOKENIZER_FILES if all((path / f).is_file() for f in name.split(" + "))
            ]
            if slow:
                raise CheckpointError(
                    f"{tok_file}: missing; the folder has only a slow tokenizer's {slow[0]}, and only "
                    "tokenizer.json is read here: write it with transformers, "
                    f"AutoTokenizer.from_pretrained({str(path)!r}).save_pretrained({str(path)!r})"
                )
            raise CheckpointError(
                f"{tok_file}: missing, and no other tokenizer file beside it (save_pretrained of the model alone "
                "writes none): write the base model's there with transformers, "
                f"AutoTokenizer.from_pretrained('<base model>').save_pretrained({str(path)!r})"
            )
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust parser's errors are one-line already
            raise CheckpointError(f"{tok_file}: cannot be parsed: {e}") from None
        config = read_json_file(path / "tokenizer_config.json")
        # The legacy layout (a tokenizer_config.json without added_tokens_decoder) names the special tokens in
        # special_tokens_map.json, whose names then win, as transformers reads them; later exports ignore it.
        if "added_tokens_decoder" not in config:
            special_map = read_json_file(path / "special_tokens_map.json")
            config.update({key: value for key, value in special_map.items() if key in SPECIAL_TOKEN_KEYS})
        # transformers >= 4.50 saves the template as chat_template.jinja (no longer in tokenizer_config.json);
        # where both exist, the file wins, as in transformers.
        template_file = path / "chat_template.jinja"
        template_source = path / "tokenizer_config.json"
        check_link(template_file)
        if template_file.is_file():
            try:
                config["chat_template"] = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{template_file}: cannot be read ({e})") from None
            template_source = template_file
        model_config = read_json_file(path / "config.json")
        generation = read_json_file(path / "generation_config.json")

        def special(key: str) -> tuple[list[int], str]:
            # generation_config.json wins over config.json, which wins over tokenizer_config.json
            for name, source in (("generation_config.json", generation), ("config.json", model_config)):
                value = source.get(f"{key}_token_id")
                if value is not None:
                    ids = value if isinstance(value, list) else [value]
                    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                        raise CheckpointError(f"{path / name}: {key}_token_id must be an id or a list of ids")
                    return ids, str(path / name)
            token_id = tok.token_to_id(_token_text(config.get(f"{key}_token")) or "")
            return ([] if token_id is None else [token_id]), str(path / "tokenizer_config.json")

        bos, bos_source = special("bos")
        tokenizer = cls(tok, config, bos[0] if bos else None, frozenset(special("eos")[0]), bos_source)
        if tokenizer.chat_template is not None:
            # A template that cannot compile fails here, naming the file, not in every chat request later.
            try:
                compile_template(tokenizer.chat_template)
            except TemplateError as e:
                raise CheckpointError(f"{template_source}: the chat template does not compile: {e}") from None
        return tokenizer

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        # A rendered chat template may already start with BOS: never add a second one.
        if add_special and self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def encode_text(self, text: str, bos: bool = True) -> list[int]:
        """A prompt's tokens, BOS first where the model takes one (and `bos`): every character of it as text."""
        ids = self._plain.encode(text, add_special_tokens=False).ids
        if bos and self.add_bos:
            ids.insert(0, self.bos_id)
        return ids

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, template_kwargs: dict | None = None
    ) -> list[int]:
        """The rendered chat template's tokens (its own BOS included), the messages' contents as text.
        `template_kwargs`: the template's own switches (vLLM's chat_template_kwargs: Qwen3's enable_thinking)."""
        text = self.apply_chat_template(messages, add_generation_prompt, template_kwargs)
        literal = [i for i, m in enumerate(messages) if self._has_special_spelling(m["content"])]
        if not literal:  # the common case: nothing in the contents could be read as a token
            return self.encode(text, add_special=False)
        rendered, restore = self._render_marked(
            messages, literal, text, add_generation_prompt, template_kwargs
        )
        # The rendered text cut where tokenizers would cut it, at the template's own special tokens (the only
        # spellings left once the contents' are placeholders); each piece between them, the contents' spellings
        # put back, encoded as text, as tokenizers encodes the pieces between special tokens.
        ids: list[int] = []
        start = 0
        for marker_start, marker_end, token_id in self._template_markers(rendered):
            ids += self._encode_segment(restore(rendered[start:marker_start]), first=start == 0)
            ids.append(token_id)
            start = marker_end
        return ids + self._encode_segment(restore(rendered[start:]), first=start == 0)

    def _has_special_spelling(self, content: str) -> bool:
        return self._special_spelling is not None and self._special_spelling.search(content) is not None

    def _render_marked(
        self,
        messages: list[dict],
        literal: list[int],
        text: str,
        add_generation_prompt: bool,
        template_kwargs: dict | None = None,
    ) -> tuple[str, Callable[[str], str]]:
        """The template rendered with every special token's spelling in the contents of messages `literal`
        replaced by a placeholder of this call (private-use characters no content holds), and the function that
        puts the spellings back. Refused when putting them back does not give `text`, the template's own
        rendering: a template that rewrites those contents (upper-cases them, escapes them)."""
        contents = [m["content"] for m in messages]
        while True:  # a nonce no content holds (a person cannot guess it; this only rules out the impossible)
            nonce = "".join(chr(_NONCE_BASE + b) for b in secrets.token_bytes(8))
            if not any(nonce in c for c in contents):
                break
        spelled: list[str] = []

        def mark(found: re.Match) -> str:
            spelled.append(found.group())
            digits = "".join(chr(_DIGIT_BASE + int(d)) for d in str(len(spelled) - 1))
            return f"{_OPEN}{nonce}{digits}{_CLOSE}"

        marked = [
            dict(m, content=self._special_spelling.sub(mark, m["content"])) if i in literal else m
            for i, m in enumerate(messages)
        ]
        rendered = self.apply_chat_template(marked, add_generation_prompt, template_kwargs)
        placeholder = re.compile(f"{_OPEN}{nonce}([{chr(_DIGIT_BASE)}-{chr(_DIGIT_BASE + 9)}]+){_CLOSE}")

        def spelling(found: re.Match) -> str:
            index = int("".join(str(ord(c) - _DIGIT_BASE) for c in found.group(1)))
            return spelled[index] if index < len(spelled) else found.group()

        def restore(piece: str) -> str:
            return placeholder.sub(spelling, piece)

        if restore(rendered) != text:
            index = literal[0]
            token = self._special_spelling.search(messages[index]["content"]).group()
            raise InvalidRequest(
                f"messages[{index}].content",
                f"contains {token!r}, the spelling of one of this model's control tokens, in a message its "
                "chat template rewrites; remove it from the message",
            )
        return rendered, restore

    def _template_markers(self, text: str) -> Iterator[tuple[int, int, int]]:
        """(start, end, id) of each special token in `text`, as tokenizers finds them: leftmost, longest, with
        the whitespace beside it that the token strips (lstrip / rstrip)."""
        end = 0
        for found in self._special_spelling.finditer(text):
            lstrip, rstrip = self._special_strip[found.group()]
            start = max(found.start(), end)
            if lstrip:
                while start > end and text[start - 1].isspace():
                    start -= 1
            end = found.end()
            if rstrip:
                while end < len(text) and text[end].isspace():
                    end += 1
            yield start, end, self._tok.token_to_id(found.group())

    def _encode_segment(self, text: str, first: bool) -> list[int]:
        """`text`'s tokens, special tokens' spellings as text, as tokenizers encodes a piece of a longer input
        between special tokens: a SentencePiece tokenizer whose "▁" goes before the first word only ("first")
        adds none to a piece that is not at the start of the input (`first`)."""
        if not text:
            return []
        return (self._plain if first else self._plain_mid).encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, template_kwargs: dict | None = None
    ) -> str:
        """The template rendered as transformers renders it; `template_kwargs` are further variables for it (as
        transformers' apply_chat_template(**kwargs)), under the ones set here: they can switch a template's
        feature (enable_thinking), never replace the messages, the special tokens or the generation prompt."""
        if self.chat_template is None:
            raise InvalidRequest("messages", "this model has no chat template")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise InvalidRequest("messages", f"message {i} must have a string 'role' and 'content'")
        check_template_kwargs(template_kwargs)
        for key, value in (template_kwargs or {}).items():
            # A template prints its variables outside any message: a special token's spelling there would be
            # read as the token (a turn the client wrote itself), as in a participant's name.
            if any(self._has_special_spelling(text) for text in json_strings(value)):
                raise InvalidRequest(
                    "chat_template_kwargs",
                    f"{key}: holds a special token's spelling, which a template prints as one",
                )
        variables = {
            **(template_kwargs or {}),
            "messages": messages,
            # Passed as transformers passes them: templates test `tools is not none` without `is defined`.
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **self.template_tokens,
        }
        try:
            return compile_template(self.chat_template).render(**variables)
        except TemplateError as e:
            raise InvalidRequest("messages", f"chat template: {e}") from None
        except (TypeError, ValueError, ArithmeticError, LookupError) as e:
            if not template_kwargs:
                raise  # the template on the server's own variables: a bug, logged with its traceback
            # a client's variable of a type the template does not expect (a string compared with a number)
            raise InvalidRequest("chat_template_kwargs", f"chat template: {type(e).__name__}: {e}") from None

    def stream_decoder(self, context_ids: Sequence[int] = ()) -> StreamDecoder:
        """`context_ids`: tokens already shown (the end of the prompt), so that the first new token
        keeps its leading space (SentencePiece strips a space at the start of a decode)."""
        return StreamDecoder(self, context_ids)


def _plain_tokenizer(serialized: str) -> HFTokenizer:
    """A tokenizer that encodes special tokens' spellings as text."""
    tok = HFTokenizer.from_str(serialized)
    tok.encode_special_tokens = True
    return tok


def _components(node) -> Iterator[dict]:
    """Every component ({"type": ...} object) in a part of tokenizer.json, nested ones (a Sequence's) too."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _components(value)
    elif isinstance(node, list):
        for value in node:
            yield from _components(value)


def _mid_text_spec(spec: dict) -> dict | None:
    """The tokenizer for a piece of a longer input that is not its start, where a Metaspace pre-tokenizer that
    puts "▁" before the first word only (prepend_scheme "first") puts none, as tokenizers does past the start
    of an input; None where no pre-tokenizer does so (the tokenizer is then the same)."""
    pre_tokenizer = copy.deepcopy(spec.get("pre_tokenizer"))
    changed = False
    for component in _components(pre_tokenizer):
        if component.get("type") == "Metaspace" and component.get("prepend_scheme") == "first":
            component["prepend_scheme"] = "never"
            changed = True
    return {**spec, "pre_tokenizer": pre_tokenizer} if changed else None


def _byte_fallback_ids(tok: HFTokenizer, spec: dict) -> frozenset[int]:
    """The ids a ByteFallback decoder reads as bytes ("<0x41>"); none without one."""
    if not any(c.get("type") == "ByteFallback" for c in _components(spec.get("decoder"))):
        return frozenset()
    vocab = tok.get_vocab(with_added_tokens=True)
    return frozenset(i for token, i in vocab.items() if _BYTE_TOKEN.fullmatch(token))


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _post_processor_bos(tok: HFTokenizer) -> int | None:
    """The id of the special token tokenizer.json's post-processor puts first in a single sequence (Llama's
    TemplateProcessing starts it with BOS), or None where it adds none first."""
    processor = json.loads(tok.to_str()).get("post_processor") or {}
    processors = (
        processor.get("processors", [processor]) if processor.get("type") == "Sequence" else [processor]
    )
    for p in processors:
        if p.get("type") == "TemplateProcessing" and p.get("single"):
            first = p["single"][0].get("SpecialToken", {}).get("id")
            if first is None:
                return None
            ids = ((p.get("special_tokens") or {}).get(first) or {}).get("ids") or []
            return ids[0] if len(ids) == 1 else tok.token_to_id(first)
    return None
