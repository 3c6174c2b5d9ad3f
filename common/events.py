"""What a generation takes and what it yields: the contract between the engine, the worker and the web.

Torch-free on purpose: the web process imports it to validate requests.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal


class InvalidRequest(ValueError):
    """A request the engine refuses before any compute; `field` names the offending parameter and `code`
    the kind of refusal (OpenAI's codes where one fits: context_length_exceeded)."""

    def __init__(self, field: str, message: str, code: str = "invalid_request"):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.code = code


def unicode_text(text: str, field: str) -> str:
    """`text` if it can be encoded, else InvalidRequest: JSON lets a client send half of a UTF-16
    surrogate pair (a "\\ud83d" cut from its partner), which no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            field, f"holds an unpaired surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}"
        ) from None
    return text


# Below this temperature a draw is the argmax in all but exact ties, and dividing by it would overflow
# the logits (vLLM draws the same line); such requests are served greedily.
MIN_TEMPERATURE = 1e-5
# The penalty divides or multiplies logits; past these bounds it would overflow them (the page offers 0.5-2).
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
SEED_RANGE = (-(2**63), 2**63 - 1)  # an int64, as OpenAI takes it: one seed, one stream of draws


# OpenAI's temperature range, which the API holds requests (and a model's recommended default) to
MAX_API_TEMPERATURE = 2.0
MAX_N_INDENT = 256  # columns; deeper code is not written by hand
MAX_STOP_TOKEN_IDS = 64  # a request's own stop tokens, at most
MAX_PREDICTION_CHARS = 1 << 20  # a prediction's text: more than any context here holds
# The most alternatives a token's logprobs may list (OpenAI's top_logprobs limit)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 means no top-k cut
    repetition_penalty: float = 1.0  # 1 means none; > 1 discourages tokens already seen
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the text stops before the first match (after it: below)
    # None: no logprobs; N >= 0: each token's log-probability and the N most likely tokens at its step
    logprobs: int | None = None
    # the same for the prompt's tokens, each given the ones before it (an echoed completion's; vLLM's name)
    prompt_logprobs: int | None = None
    # > 0: the text stops before a line indented less than this (llama.cpp's n_indent): a code completion
    # inside a block ends where the block does
    n_indent: int = 0
    # vLLM's: the model's end tokens do not end the reply (max_new_tokens or a stop does: a fixed-length
    # benchmark's); more tokens that end it, with their text unless special; the matched stop string kept
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    # OpenAI's Predicted Outputs: text the reply is expected to repeat (an edited file's old version), which
    # speculative decoding drafts from; the reply is the same with or without it, only sooner
    prediction: str = ""

    def __post_init__(self):
        def bad(name: str, why: str):
            raise InvalidRequest(name, why)

        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            bad("max_new_tokens", "must be an integer")
        if self.max_new_tokens < 1:
            bad("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                bad(name, f"must be a finite number, got {value!r}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # frozen: set once, here
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            bad("repetition_penalty", f"must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            bad("seed", f"must be a 64-bit signed integer, in [-2**63, 2**63 - 1], got {self.seed}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            bad("stop", "must be a string or a list of strings")
        if not all(self.stop):
            bad("stop", "a stop sequence must not be empty (it would end every reply before it began)")
        for text in self.stop:
            unicode_text(text, "stop")  # half a surrogate pair could never match what the model writes
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS
            ):
                bad(name, f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")
        if (
            not isinstance(self.n_indent, int)
            or isinstance(self.n_indent, bool)
            or not 0 <= self.n_indent <= MAX_N_INDENT
        ):
            bad("n_indent", f"must be an integer in [0, {MAX_N_INDENT}], got {self.n_indent!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be a boolean, got {getattr(self, name)!r}")
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))  # frozen: set once, here
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            bad("stop_token_ids", f"must be a list of token ids (integers), got {ids!r:.60}")
        if len(ids) > MAX_STOP_TOKEN_IDS or any(i < 0 for i in ids):
            bad("stop_token_ids", f"takes at most {MAX_STOP_TOKEN_IDS} ids, each >= 0")
        if not isinstance(self.prediction, str):
            bad("prediction", f"must be text, got {self.prediction!r:.60}")
        if len(self.prediction) > MAX_PREDICTION_CHARS:
            bad(
                "prediction",
                f"may be at most {MAX_PREDICTION_CHARS:,} characters, got {len(self.prediction):,}",
            )
        unicode_text(self.prediction, "prediction")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Prefilled:
    """The prompt went through the model; the first token is being sampled."""

    prompt_tokens: int
    prefill_ms: float
    cached_tokens: int = 0  # of prompt_tokens, reused from an earlier request's KV cache (not prefilled)
    # with SamplingParams.prompt_logprobs: one entry per prompt token as TextDelta.logprobs has them, the
    # first's logprob None; a special token the tokenizer added (not in the prompt's text) has "special": true
    prompt_logprobs: list[dict] | None = None
    kind: Literal["prefilled"] = "prefilled"


@dataclass
class TextDelta:
    """New text. `text` may be empty while a multi-byte character is incomplete.

    `t` is seconds since `generate` was called, taken when the last of `token_ids` was produced:
    the live counters come from these worker-side stamps, never from arrival times. `decode_steps`,
    `draft_n` and `draft_n_accepted` are the generation's speculation so far (Stats has them too).
    """

    text: str
    token_ids: list[int]
    t: float
    decode_steps: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0
    # with SamplingParams.logprobs: one entry per token of `token_ids` that is part of the text (a stop token
    # is not): {"id", "token", "bytes", "logprob", "top": [{"id", "token", "bytes", "logprob"}, ...]}
    logprobs: list[dict] | None = None
    kind: Literal["delta"] = "delta"


@dataclass
class Stats:
    prompt_tokens: int
    completion_tokens: int
    prefill_ms: float
    ttft_ms: float
    decode_tok_s: float  # (n - 1) / (t_last - t_first); 0 when fewer than two tokens
    total_ms: float
    token_times: list[float] = field(default_factory=list)  # seconds since start, one per token
    bytes_per_token: int = 0  # weight + KV bytes one decode step reads; 0 when unknown
    peak_bandwidth_gbs: float | None = None  # the device's measured or rated read bandwidth; None on CPU
    cached_tokens: int = 0  # of prompt_tokens, reused from an earlier request's KV cache (not prefilled)
    # Speculative decoding (inference/speculative.py): model steps after the prefill, draft tokens proposed,
    # and those the model accepted; tokens per step = (completion_tokens - 1) / decode_steps.
    decode_steps: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0
    # a request's prediction (SamplingParams.prediction): its tokens (0: none), and of the drafts, those taken
    # from it and those of them the model accepted
    prediction_tokens: int = 0
    prediction_draft_n: int = 0
    prediction_draft_n_accepted: int = 0

    @property
    def bandwidth_gbs(self) -> float:
        return self.bytes_per_token * self.decode_tok_s / 1e9


@dataclass
class Done:
    finish_reason: Literal["stop", "length", "cancelled"]
    text: str
    stats: Stats
    # what ended it: the model's end token ("eos"), a stop string, a token of the request's stop_token_ids, a
    # shallower line (n_indent), the token limit, a cancel (None: not said); stop_reason is vLLM's: the stop
    # string or token
    ended_by: Literal["eos", "stop_string", "stop_token", "indent", "length", "cancelled"] | None = None
    stop_reason: str | int | None = None
    kind: Literal["done"] = "done"


Event = Prefilled | TextDelta | Done


def decode_tok_s(token_times: list[float]) -> float:
    if len(token_times) < 2 or token_times[-1] <= token_times[0]:
        return 0.0
    return (len(token_times) - 1) / (token_times[-1] - token_times[0])


def to_dict(event: Event) -> dict:
    return asdict(event)
