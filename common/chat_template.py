"""Chat templates rendered as transformers renders them: its sandboxed jinja2 environment, its globals
(raise_exception, strftime_now), its tojson, and TRL's `{% generation %}` marks read as plain text; and the
check of a client's further template variables (the API's chat_template_kwargs), which the web and the
worker both make."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2 import nodes
from jinja2.defaults import DEFAULT_NAMESPACE
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.events import InvalidRequest, unicode_text


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


# The variables and functions a template gets from its renderer (Tokenizer.apply_chat_template, the environment
# below): an API client's chat_template_kwargs may add others (Qwen3's enable_thinking), never replace these.
RESERVED_NAMES = frozenset(
    {
        "messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "unk_token",
        "pad_token", "raise_exception", "strftime_now", *DEFAULT_NAMESPACE,  # jinja's range, namespace, ...
    }
)  # fmt: skip


def check_template_kwargs(template_kwargs: dict | None, field: str = "chat_template_kwargs") -> None:
    """Further template variables: an object whose keys are names a template can read, none of the renderer's
    own (InvalidRequest naming `field` if not)."""
    if template_kwargs is None:
        return
    if not isinstance(template_kwargs, dict):
        raise InvalidRequest(
            field, 'must be an object of the chat template\'s variables, e.g. {"enable_thinking": false}'
        )
    for key, value in template_kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidRequest(field, f"{key!r} is not a name a template can read")
        if key in RESERVED_NAMES:
            raise InvalidRequest(
                field, f"{key!r} is set by the server (the messages, the special tokens, ...)"
            )
        for text in json_strings(value):  # printed by a template: text the tokenizer can take, as a message's
            unicode_text(text, f"{field}.{key}")


def json_strings(value):
    """Every string in a JSON value, the keys of its objects included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from json_strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from json_strings(key)
            yield from json_strings(item)


@lru_cache(maxsize=16)
def compile_template(template: str):
    """A chat template compiled once (cached by its text); jinja2's TemplateError for one that cannot be."""
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
