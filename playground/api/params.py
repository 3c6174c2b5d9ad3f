"""OpenAI request bodies -> a JobSpec, validated once at the edge; every refusal names its field.

Every field a request may carry is one of four kinds here:
- honoured: read below (model, messages / prompt, max_tokens, n, temperature, top_p, top_k, stop, seed, a
  completion's echo, ...);
- refused unless given the value that changes nothing (best_of, chat's echo, tools, penalties, other modalities, and
  the template switches and samplers of vLLM's and llama.cpp's servers that a client written for them sends):
  a 400 naming the field, never a silent drop;
- ignored, because it changes nothing in the reply (user, metadata, store, service_tier, caching hints, and
  the settings of a sampler that is switched off): IGNORED below;
- anything else: refused as an unrecognized argument, as OpenAI's own API refuses it (see UNKNOWN FIELDS).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace

from common.chat_template import check_template_kwargs
from common.events import (
    MAX_API_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    InvalidRequest,
    SamplingParams,
    unicode_text,
)
from common.protocol import MAX_PROMPT_IDS, JobSpec, is_token_id

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# A message's other fields are refused (as OpenAI's are), but for the empty ones the openai client's replies carry.
MESSAGE_FIELDS = frozenset({"role", "content", "name"})
EMPTY_MESSAGE_FIELDS = frozenset({"refusal", "annotations", "audio", "function_call", "tool_calls"})
# OpenAI's own limit; every stop string is searched for after every token, so a long list would
# slow the worker for everyone in the queue.
MAX_STOP_SEQUENCES = 4
# What a request may have stored with its run (the saved generation's params) beyond its prompt: each stop
# string's length, and the chat template's variables as JSON, in characters and levels of nesting.
MAX_STOP_CHARS = 256
MAX_TEMPLATE_KWARGS_CHARS = 4096
MAX_TEMPLATE_KWARGS_DEPTH = 8
# What a completion's prompt may be, as a refusal says it (OpenAI's, vLLM's and llama.cpp's forms)
PROMPT_FORMS = "must be a string, a list of token ids (integers >= 0), or a list holding one of either"
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's legacy API
# A request's choices (n) at most: each is a generation of its own, run one after another
MAX_CHOICES = 8
# OpenAI's pattern for a participant's name; it also keeps a control token's spelling (`<|...|>`) out of the
# chat template, which copies names outside any message's content.
PARTICIPANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Other servers' request fields that would change the reply, each with the values that change nothing.
# A client written for vLLM or llama.cpp sends them through the openai client's extra_body.
EXTENSION_NEUTRAL = {
    "min_tokens": (0,),
    "min_p": (0, 0.0),
    "skip_special_tokens": (True,),
    "bad_words": ([],),
    "allowed_token_ids": ([],),
    "use_beam_search": (False,),
    "prompt_logprobs": (),  # vLLM: 0 still asks for the prompt tokens' own log-probabilities
    "truncate_prompt_tokens": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "structural_tag": (),
    "return_token_ids": (False,),  # vLLM: the reply's token ids, which this server does not return
    # vLLM's chat template switches: the prompt is the checkpoint's own template, rendered as transformers
    # renders it with a generation prompt, and nothing else (add_special_tokens: below, per endpoint)
    "chat_template": (),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "documents": (),
    "mm_processor_kwargs": ({},),
    "media_io_kwargs": ({},),
    # llama.cpp's samplers, each at the value that switches it off (their own settings: IGNORED)
    "grammar": (),
    "json_schema": (),
    "typical_p": (1, 1.0),
    "mirostat": (0,),
    "tfs_z": (1, 1.0),
    "top_n_sigma": (-1, -1.0),
    "xtc_probability": (0, 0.0),
    "dry_multiplier": (0, 0.0),
    "dynatemp_range": (0, 0.0),
    "repeat_penalty": (1, 1.0),
    "n_probs": (0,),  # llama.cpp's logprobs: use logprobs (top_logprobs in chat)
    "min_keep": (0, 1),  # 1 is what top_k and top_p keep at least anyway
    "n_predict": (),
    # OpenAI's own, for models that reason or speak
    "reasoning_effort": (),
    "verbosity": (),
    "audio": (),
    "web_search_options": (),
}
# The sampling a model's generation_config.json may recommend (inference/engine.py's GENERATION_DEFAULT_KEYS),
# and its max_new_tokens: a request's length when it gives none (chat and completions alike, as vLLM)
MODEL_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens")
# What a refusal adds for a field that has a counterpart here.
INSTEAD = {
    "repeat_penalty": "use repetition_penalty (here it covers the whole context)",
    "n_predict": "use max_tokens",
    "frequency_penalty": "use repetition_penalty (> 1 discourages repeats)",
    "presence_penalty": "use repetition_penalty (> 1 discourages repeats)",
}
# llama.cpp's window of the penalties: here repetition_penalty looks at the whole context, llama.cpp's -1.
PENALTY_WINDOWS = ("repeat_last_n", "penalty_last_n")
# The fields read by parse_request and _refuse_unsupported; `messages` and `prompt` each on its endpoint.
HONOURED = frozenset(
    {
        "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
        "top_k", "repetition_penalty", "seed", "stop", "n", "best_of", "frequency_penalty", "presence_penalty",
        "logprobs", "top_logprobs", "tools", "functions", "tool_choice", "function_call", "echo", "suffix",
        "logit_bias", "response_format", "modalities", "add_special_tokens", "chat_template_kwargs", "n_indent",
        "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "prediction", *PENALTY_WINDOWS,
    }
)  # fmt: skip
# Fields that change nothing in the reply, whatever their value: accepted and not used.
IGNORED = frozenset(
    {
        # OpenAI's: who asks, what to keep, billing and caching hints; parallel_tool_calls only means something
        # with tools (refused)
        "user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
        "prompt_cache_retention", "safety_identifier",
        # vLLM's: scheduling and caching, and the settings of refused features (beam search, guided decoding)
        "request_id", "priority", "cache_salt", "length_penalty", "guided_decoding_backend",
        "guided_whitespace_pattern",
        # llama.cpp's: caching and timing, and the settings of samplers that are off unless the switch
        # above (refused unless off) turns them on
        "cache_prompt", "id_slot", "timings_per_token", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
        "dry_sequence_breakers", "xtc_threshold", "mirostat_tau", "mirostat_eta", "dynatemp_exponent",
        "penalize_nl", "post_sampling_probs",
    }
)  # fmt: skip
# UNKNOWN FIELDS. Any other field is refused, naming it, as OpenAI's API refuses it ("Unrecognized request
# argument supplied"): this server cannot tell whether a field it does not know would change the reply, and a
# client that sent one meant something by it (a misspelt `max_token`, a newer server's sampler, the Responses
# API's `max_output_tokens`). vLLM (with a warning in its log) and llama.cpp ignore such fields, which is how a
# request silently gets another reply than the one asked for. A field set to null is taken as absent, whatever its name: clients in typed
# languages send every optional field they know, most as null. The ones that the official openai client and the
# common clients send (stream_options, user, metadata, store, service_tier, prediction, parallel_tool_calls,
# prompt_cache_key, ...) are in IGNORED or honoured above.


@dataclass
class ApiRequest:
    spec: JobSpec
    stream: bool
    include_usage: bool
    echo: bool = False  # a completion's reply begins with its prompt (with logprobs: the prompt's too)
    n: int = 1  # choices: generations of the same request (with a seed, choice i's is seed + i)

    @property
    def logprobs(self) -> bool:
        return self.spec.params.get("logprobs") is not None


def parse_request(
    body: dict,
    chat: bool,
    max_new_tokens: int,
    max_prompt_chars: int,
    job_id: str | None = None,
    model_defaults: dict | None = None,
) -> ApiRequest:
    """Raises InvalidRequest(field, message) with the client's own field name. `job_id`: the request's id,
    which the job takes (a new one when None). `model_defaults`: the model's recommended sampling (its
    generation_config.json's temperature, top_p, top_k, repetition_penalty, from its worker), taken for what
    the request leaves out, over OpenAI's defaults (as vLLM takes them).

    Without max_tokens a chat reply may run to `max_new_tokens` (the server's cap, which also clips larger
    requests): like OpenAI's chat API and llama.cpp's server it ends at a stop token, the cap, or the
    end of the context (the engine clips to what fits after the prompt). A completion without it is 16
    tokens long at most, the legacy completions API's default (OpenAI's and vLLM's). A model whose
    generation_config.json gives max_new_tokens has that for both (under the cap). Whether a prompt
    fits the context only the worker's tokenizer can tell; `max_prompt_chars` turns away the absurd ones
    early.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        given = "is required" if model in (None, "") else f"must be a string, got {json.dumps(model)[:40]}"
        raise InvalidRequest("model", f"{given}: one of the ids that GET /v1/models lists")
    _refuse_unsupported(body, chat)
    stream = _optional(body, "stream", bool, False)
    include_usage = False
    if body.get("stream_options") is not None:
        options = body["stream_options"]
        if not stream:
            raise InvalidRequest("stream_options", "is only allowed when stream is true")
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options", "must be an object")
        include_usage = _optional(options, "include_usage", bool, False, "stream_options.include_usage")
        _refuse_stream_options(options)

    params = _sampling_params(body, max_new_tokens, chat, model_defaults or {})
    logprobs = _logprobs(body, chat)
    if logprobs is not None:
        params["logprobs"] = logprobs
    named = {"id": job_id} if job_id is not None else {}
    echo = False
    if chat:
        messages = _messages(body.get("messages"))
        spec = JobSpec(model, messages=messages, chat=True, params=params, source="api",
                       template_kwargs=_template_kwargs(body.get("chat_template_kwargs")), **named)  # fmt: skip
        prompt_field, chars = "messages", sum(len(m["content"]) for m in messages)
    else:
        suffix = _suffix(body.get("suffix"))
        prompt = _prompt(body.get("prompt"), suffix, most_ids=min(max_prompt_chars, MAX_PROMPT_IDS))
        ids = prompt if isinstance(prompt, list) else None
        echo = _optional(body, "echo", bool, False)
        if echo and suffix is not None:
            raise InvalidRequest("echo", "cannot be combined with suffix (a fill-in-the-middle reply)")
        if echo and logprobs is not None:
            params["prompt_logprobs"] = logprobs
        text = prompt if ids is None else None
        spec = JobSpec(
            model, prompt=text, prompt_ids=ids, suffix=suffix, params=params, source="api", **named
        )
        prompt_field, chars = "prompt", len(text or "") + len(suffix or "")  # ids: counted by _prompt
    for field, size in ((prompt_field, chars), ("prediction", len(params["prediction"]))):
        if size > max_prompt_chars:
            raise InvalidRequest(
                field, f"is {size} characters long; the server takes at most {max_prompt_chars}"
            )
    n = body.get("n")
    n = 1 if n is None else n
    return ApiRequest(spec=spec, stream=stream, include_usage=include_usage, echo=echo, n=n)


def _sampling_params(body: dict, max_new_tokens: int, chat: bool, model_defaults: dict) -> dict:
    # max_completion_tokens is the newer name of max_tokens; when both are sent it wins.
    tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # OpenAI takes top_p=0 (clients send it for determinism): the smallest nucleus is the one most
    # likely token, i.e. a greedy draw; the engine's top_p itself must stay in (0, 1].
    top_p = body.get("top_p")
    top_p_zero = top_p == 0 and not isinstance(top_p, bool)
    fields = {
        "max_new_tokens": body.get(tokens_field),
        "temperature": body.get("temperature"),
        "top_p": None if top_p_zero else top_p,
        # vLLM / llama.cpp extensions (extra_body in the openai client); vLLM's -1 is its "off", our 0
        "top_k": 0 if _same_value(body.get("top_k"), -1) else body.get("top_k"),
        "repetition_penalty": body.get("repetition_penalty"),
        "seed": None if _random_seed(body.get("seed")) else body.get("seed"),
        "stop": _stop(body.get("stop")),
        "n_indent": body.get("n_indent"),  # llama.cpp's: a completion inside a block ends with the block
        # vLLM's: a fixed length (end tokens ignored), the request's own stop tokens, the stop string kept
        "ignore_eos": body.get("ignore_eos"),
        "stop_token_ids": _stop_token_ids(body.get("stop_token_ids")),
        "include_stop_str_in_output": body.get("include_stop_str_in_output"),
        "prediction": _prediction(body.get("prediction")),  # OpenAI's Predicted Outputs: drafts, sooner
    }
    defaults = {  # OpenAI's, then the model's own (only MODEL_DEFAULT_KEYS: a worker's word; the cap below)
        "max_new_tokens": max_new_tokens if chat else min(COMPLETIONS_MAX_TOKENS, max_new_tokens),
        "temperature": 1.0,
        **{key: value for key, value in model_defaults.items() if key in MODEL_DEFAULT_KEYS},
    }
    given = {name: value for name, value in fields.items() if value is not None}
    try:
        params = SamplingParams(**{**defaults, **given})
    except InvalidRequest as exc:
        field = tokens_field if exc.field == "max_new_tokens" else exc.field
        raise InvalidRequest(field, exc.message) from None
    if params.temperature > MAX_API_TEMPERATURE:
        raise InvalidRequest(
            "temperature", f"must be in [0, {MAX_API_TEMPERATURE:g}], got {params.temperature}"
        )
    if top_p_zero:
        params = replace(params, temperature=0.0)
    return {
        **{name: value for name, value in asdict(params).items() if name != "logprobs"},  # set by the caller
        "max_new_tokens": min(params.max_new_tokens, max_new_tokens),
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
    }


def _prediction(prediction) -> str | None:
    """OpenAI's `prediction` ({"type": "content", "content": text or a list of text parts}) as its text."""
    if prediction is None:
        return None
    content = prediction.get("content") if isinstance(prediction, dict) else None
    if (
        not isinstance(prediction, dict)
        or prediction.get("type") != "content"
        or set(prediction) - {"type", "content"}
    ):
        raise InvalidRequest("prediction", 'must be {"type": "content", "content": ...}')
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise InvalidRequest("prediction", "content must be text or a list of text parts")
    return content


def _stop_token_ids(ids) -> tuple | None:
    """vLLM's list of ids as the sampling parameters take it (their check says what is wrong)."""
    if ids is None:
        return None
    if not isinstance(ids, list):
        raise InvalidRequest("stop_token_ids", f"must be a list of token ids, got {ids!r:.60}")
    return tuple(ids)


def _stop(stop) -> tuple | None:
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not isinstance(stop, list | tuple):
        raise InvalidRequest("stop", "must be a string or a list of strings")
    if len(stop or ()) > MAX_STOP_SEQUENCES:
        raise InvalidRequest("stop", f"takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}")
    for text in stop or ():
        if isinstance(text, str) and len(text) > MAX_STOP_CHARS:
            raise InvalidRequest(
                "stop", f"a stop sequence may be at most {MAX_STOP_CHARS} characters, got {len(text):,}"
            )
    return tuple(stop) if stop else None


def json_depth(value) -> int:
    """How deeply a parsed JSON value nests (a scalar: 0), without recursion: a value nested past Python's
    recursion limit is measured, not a RecursionError."""
    depth, level = 0, [(value, 0)]
    while level:
        item, d = level.pop()
        if isinstance(item, dict | list):
            depth = max(depth, d + 1)
            level.extend((child, d + 1) for child in (item.values() if isinstance(item, dict) else item))
    return depth


def _template_kwargs(value) -> dict | None:
    """vLLM's chat_template_kwargs: further variables for the model's chat template (Qwen3's
    {"enable_thinking": false}), checked here as the worker checks them; {} or absent: none. Bounded in
    depth and size: they are stored with the run."""
    if json_depth(value) > MAX_TEMPLATE_KWARGS_DEPTH:
        raise InvalidRequest(
            "chat_template_kwargs", f"may nest at most {MAX_TEMPLATE_KWARGS_DEPTH} levels deep"
        )
    check_template_kwargs(value)
    size = len(json.dumps(value)) if value else 0
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidRequest(
            "chat_template_kwargs",
            f"may be at most {MAX_TEMPLATE_KWARGS_CHARS:,} characters as JSON, got {size:,}",
        )
    return value or None


def chat_messages(messages) -> list[dict]:
    """A chat's messages checked as /v1/chat/completions checks them (for /tokenize)."""
    return _messages(messages)


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "must be a non-empty list of {role, content} objects")
    rendered = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(where, "must be an object with role and content")
        role = message.get("role")
        role = CHAT_ROLES.get(role) if isinstance(role, str) else None  # a list or object is no key
        if role is None:
            raise InvalidRequest(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}")
        _refuse_message_fields(message, where)
        turn = {"role": role, "content": _content(message.get("content"), f"{where}.content")}
        name = message.get("name")
        if name is not None:  # the chat template gets it, as transformers gives it; most templates ignore it
            if not isinstance(name, str) or not PARTICIPANT_NAME.fullmatch(name):
                raise InvalidRequest(
                    f"{where}.name", "must be 1 to 64 letters, digits, underscores or hyphens"
                )
            turn["name"] = name
        rendered.append(turn)
    return rendered


def _refuse_message_fields(message: dict, where: str) -> None:
    for key, value in message.items():
        if key in MESSAGE_FIELDS or value is None or (key in EMPTY_MESSAGE_FIELDS and value in ([], "")):
            continue  # null is absent, as for the request's own fields
        if key in ("tool_calls", "function_call"):
            raise InvalidRequest(f"{where}.{key}", "tool calls are not supported here (nor `tools`): the "
                                 "history must be text turns")  # fmt: skip
        raise InvalidRequest(f"{where}.{key}", "unknown field: a message takes role, content and name")


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return unicode_text(content, where)
    # The list form: [{"type": "text", "text": "..."}, ...]; only text parts mean anything to us.
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        for i, part in enumerate(content):
            if part.get("type") != "text":
                raise InvalidRequest(f"{where}[{i}]", "only text parts ({type: text, text}) are supported")
            if not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}[{i}].text", "a text part's text must be a string")
        return unicode_text("".join(part["text"] for part in content), where)
    raise InvalidRequest(where, "must be a string or a list of text parts")


def _prompt(prompt, suffix: str | None, most_ids: int) -> str | list[int]:
    """The prompt as text, or as token ids ([int, ...], or [[int, ...]]) as OpenAI's, vLLM's and llama.cpp's
    servers take them: at most `most_ids`, and never with a `suffix` (fill in the middle takes text). A list of
    several prompts (a batch) is refused."""
    if isinstance(prompt, list) and prompt and all(isinstance(each, str | list) for each in prompt):
        if len(prompt) > 1:
            batch = f"holds {len(prompt)} prompts: batching several prompts is not supported"
            raise InvalidRequest("prompt", f"{batch}, send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
        for token in prompt:
            if not is_token_id(token):
                raise InvalidRequest("prompt", f"{PROMPT_FORMS}; got {token!r:.40} in a list of token ids")
        if suffix is not None:
            raise InvalidRequest(
                "prompt", "token ids cannot go with a suffix: fill in the middle takes the prompt as text"
            )
        if len(prompt) > most_ids:
            raise InvalidRequest(
                "prompt", f"is {len(prompt)} token ids long; the server takes at most {most_ids}"
            )
        return prompt
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt", PROMPT_FORMS)
    # with a suffix the FIM tokens are the context (a cursor at the file's start); else the model needs a token
    if not prompt and suffix is None:
        raise InvalidRequest("prompt", "must not be empty")
    return unicode_text(prompt, "prompt")


def _suffix(suffix) -> str | None:
    """OpenAI's legacy `suffix`: the text after the completion, which makes it a fill-in-the-middle request
    (the model writes what goes between the prompt and it). Empty: nothing after, a plain completion."""
    if suffix is None or suffix == "":
        return None
    if not isinstance(suffix, str):
        raise InvalidRequest("suffix", "must be a string")
    return unicode_text(suffix, "suffix")


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprobs list, or None for none. Completions: `logprobs` is that
    count (0: the chosen token's alone). Chat: `logprobs` is a switch and `top_logprobs` the count."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if logprobs == 0 and not isinstance(logprobs, bool):
            logprobs = False  # what some clients send for "off"
        if logprobs is not None and not isinstance(logprobs, bool):
            raise InvalidRequest("logprobs", f"must be a boolean on this endpoint, got {logprobs!r}")
        if top is not None and not _count(top):
            raise InvalidRequest(
                "top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}"
            )
        if not logprobs:
            if top:
                raise InvalidRequest("top_logprobs", "needs logprobs: true")
            return None
        return top or 0
    if top is not None:
        raise InvalidRequest("top_logprobs", "is for /v1/chat/completions; here logprobs is the count")
    if logprobs is None:
        return None
    if not _count(logprobs):
        raise InvalidRequest("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {logprobs!r}")
    return logprobs


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOP_LOGPROBS


def _optional(body: dict, name: str, kind: type, default, field: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise InvalidRequest(field or name, f"must be a {kind.__name__}, got {value!r}")
    return value


# stream_options' other keys, with the values that change nothing (OpenAI's obfuscation pads chunks against
# length side channels, which a stream here does not need; vLLM's usage in every chunk is not sent)
STREAM_OPTIONS_NEUTRAL = {"include_obfuscation": (True, False), "continuous_usage_stats": (False,)}


def _refuse_stream_options(options: dict) -> None:
    for key, value in options.items():
        if key == "include_usage" or value is None:
            continue
        if isinstance(value, bool) and value in STREAM_OPTIONS_NEUTRAL.get(key, ()):
            continue
        if key in STREAM_OPTIONS_NEUTRAL:
            raise InvalidRequest(f"stream_options.{key}", f"is not supported (got {value!r}); include_usage "
                                 "gives the usage in the stream's last chunk")  # fmt: skip
        raise InvalidRequest(f"stream_options.{key}", "is not an option here (it takes include_usage)")


def _is_one(value) -> bool:
    return value is None or (value == 1 and not isinstance(value, bool))  # JSON's true is not 1


def _refuse_unsupported(body: dict, chat: bool) -> None:
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES):
        raise InvalidRequest("n", f"must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    if not _is_one(body.get("best_of")):
        raise InvalidRequest("best_of", f"only best_of=1 is supported, got {body['best_of']!r}")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise InvalidRequest(name, _not_supported(name))
    if body.get("tools") or body.get("functions"):
        raise InvalidRequest("tools", "tool calling is not supported")
    if chat and body.get("echo"):
        raise InvalidRequest("echo", "is for /v1/completions (the prompt before the reply), not chat")
    if chat and body.get("suffix"):  # an empty suffix asks for nothing after the reply
        raise InvalidRequest("suffix", "is for /v1/completions (fill in the middle), not chat")
    if body.get("logit_bias"):
        raise InvalidRequest("logit_bias", "is not supported")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise InvalidRequest("response_format", "only {type: text} is supported (no JSON mode or schemas)")
    for name in ("tool_choice", "function_call"):  # function_call is tool_choice's older name
        if body.get(name) not in (None, "none", "auto"):
            raise InvalidRequest(name, "tool calling is not supported")
    if body.get("modalities") not in (None, ["text"]):
        raise InvalidRequest("modalities", 'only ["text"] is supported')
    for name, neutral in EXTENSION_NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(_same_value(value, each) for each in neutral):
            raise InvalidRequest(name, _not_supported(name))
    # vLLM's defaults: a chat template writes BOS itself (no special tokens added), a completion's prompt gets them
    if not chat and body.get("chat_template_kwargs") not in (None, {}):
        raise InvalidRequest(
            "chat_template_kwargs",
            "is for /v1/chat/completions: a completion's prompt goes through no template",
        )
    add_special_tokens = body.get("add_special_tokens")
    if add_special_tokens is not None and not _same_value(add_special_tokens, not chat):
        raise InvalidRequest(
            "add_special_tokens", f"only {str(not chat).lower()} is supported on this endpoint"
        )
    penalized = body.get("repetition_penalty") not in (None, 1, 1.0)
    for name in PENALTY_WINDOWS:  # a window changes nothing while no penalty applies
        value = body.get(name)
        if value is not None and penalized and not _same_value(value, -1):
            raise InvalidRequest(
                name, "only -1 (the whole context, where repetition_penalty applies) is supported"
            )
    endpoint, own = ("/v1/chat/completions", "messages") if chat else ("/v1/completions", "prompt")
    for name, value in body.items():
        if value is None or name == own or name in HONOURED or name in IGNORED or name in EXTENSION_NEUTRAL:
            continue
        if name in ("messages", "prompt"):
            raise InvalidRequest(name, f"is not a field of {endpoint}, which takes {own}")
        raise InvalidRequest(
            name,
            "unrecognized request argument: refused rather than ignored, as this server cannot tell "
            "whether it would change the reply",
        )


def _not_supported(name: str) -> str:
    """`name` is not supported: with the values that are (those that change nothing), or what to use instead."""
    if name in INSTEAD:
        return f"is not supported; {INSTEAD[name]}"
    neutral = EXTENSION_NEUTRAL.get(name, ())
    if neutral:
        return f"is not supported (only {json.dumps(neutral[0])}, which changes nothing)"
    return "is not supported"


def _random_seed(seed) -> bool:
    """llama.cpp's and Ollama's -1: a fresh seed, i.e. none (the integer only: -1.0 is refused as 1.0 is)."""
    return type(seed) is int and seed == -1


def _same_value(value, neutral) -> bool:
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)  # JSON's false is not 0
