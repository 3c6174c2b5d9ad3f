"""The engine the worker and the CLI use: load a model once, then stream generations as events.

    engine = Engine.load("tiny-laneformer")           # a checkpoint directory or a synthetic preset
    ids = engine.encode_prompt("def fib(n):")
    for event in engine.generate(ids, SamplingParams(max_new_tokens=64)):
        ...                                            # Prefilled, TextDelta..., Done

Token ids come from a runner (runner.ReferenceRunner, or the fast CUDA runner on a GPU); the engine
turns them into text, applies EOS and stop strings, honours cancellation and keeps the timings.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from common.env import env_number
from common.events import (
    MAX_API_TEMPERATURE,
    Done,
    Event,
    InvalidRequest,
    Prefilled,
    SamplingParams,
    Stats,
    TextDelta,
    decode_tok_s,
    unicode_text,
)
from common.names import default_model, is_hf_cache_repo, model_source, parse_repo_ref, served_name
from inference.checkpoint import CheckpointError, checkpoint_shapes, load_weights
from inference.config import ModelConfig, check_link, env_max_context, read_json_file
from inference.failures import is_memory_error
from inference.fim import find_fim_tokens, no_fim_error
from inference.hub import Progress, fetch, resolve_cache_folder
from inference.logprobs import TokenNames, delta_entry, prompt_entries, prompt_logprobs
from inference.model import Transformer
from inference.prefix_cache import PrefixCache
from inference.presets import PRESETS
from inference.runner import ReferenceRunner
from inference.speculative import SpeculationCounts
from inference.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KOG_MAX_CONTEXT (default config.DEFAULT_MAX_CONTEXT, 4096 tokens) caps the KV cache of long-context models:
# read at each load (config.env_max_context), an integer >= 2 as the max_context argument is.
# CPU threads for a decode step: one below this many weight bytes. On a small machine a second thread helps a
# small model a little while the cores are idle, but slows it many times over when other processes (web server,
# browser, tests) compete for them; KOG_CPU_THREADS overrides.
SMALL_MODEL_BYTES = 200 * 1024**2


DEFAULT_MODEL = default_model()


class LoadOutOfMemory(RuntimeError):
    """The model does not fit the device's memory at load (its weights, its RoPE tables or its KV cache): the
    message says which, how big, and what to lower; one line."""


def cpu_threads_from_env() -> int | None:
    """KOG_CPU_THREADS: the CPU threads of a decode step (unset: chosen by the model's size)."""
    threads = env_number("KOG_CPU_THREADS", 0, "an integer >= 1 (CPU threads)", integer=True, minimum=1)
    return int(threads) or None


def peak_bandwidth_from_env() -> float | None:
    """KOG_PEAK_BANDWIDTH_GBS: the GPU's peak memory bandwidth, for the share of it a decode step reaches."""
    peak = env_number("KOG_PEAK_BANDWIDTH_GBS", 0.0, "a number of GB/s > 0", minimum=1e-9)
    return peak or None


def rated_bandwidth_gbs(memory_clock_khz: int, bus_width_bits: int) -> float | None:
    """A GPU's rated memory bandwidth in GB/s: two transfers a clock (DDR, HBM) of the bus's width; None where the
    driver gives no clock or width (0)."""
    if memory_clock_khz <= 0 or bus_width_bits <= 0:
        return None
    return 2 * memory_clock_khz * 1e3 * (bus_width_bits // 8) / 1e9


def peak_bandwidth_gbs(device: torch.device) -> float | None:
    """The peak a run's bandwidth is shown against: KOG_PEAK_BANDWIDTH_GBS where set, else the GPU's rated figure;
    None on a CPU (no figure to hold a CPU's decode against)."""
    peak = peak_bandwidth_from_env()
    if device.type != "cuda":
        return None
    if peak is not None:
        return peak
    props = torch.cuda.get_device_properties(device)
    return rated_bandwidth_gbs(getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0))


def check_tokenizer_fits(path: Path, tokenizer: Tokenizer, vocab_size: int) -> None:
    """A tokenizer with ids past the model's embedding rows, or an end token it can never produce, is a
    broken checkpoint: said at load, not as a user's invalid prompt or a generation that never stops."""
    if tokenizer.max_id >= vocab_size:
        raise CheckpointError(
            f"{path / 'tokenizer.json'}: has token id {tokenizer.max_id}, past the model's vocab_size "
            f"{vocab_size} (config.json)"
        )
    specials = {"bos": {tokenizer.bos_id} - {None}, "eos": tokenizer.eos_ids}
    for kind, ids in specials.items():
        if any(i >= vocab_size for i in ids):
            raise CheckpointError(
                f"{path}: {kind}_token_id {sorted(ids)} is past the model's vocab_size {vocab_size}"
            )


def synth_cache_dir() -> Path:
    root = os.environ.get("KOG_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(root) / "kog-playground" / "synth"


def resolve_model(model: str | Path, progress: Progress | None = None) -> Path:
    """The checkpoint directory for `model`: a directory as is (an HF cache's `models--Org--Name` folder: its
    snapshot), a Hub id (`Org/Name[@revision]`, fetched into the HF cache; `progress` hears its bytes), a preset
    synthesised once into the cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        if is_hf_cache_repo(path) and not (path / "config.json").exists():
            return resolve_cache_folder(path)
        return path
    repo_ref = parse_repo_ref(str(model)) if str(model) not in PRESETS else None
    if repo_ref is not None:
        return fetch(*repo_ref, progress=progress)
    check_link(path)  # a folder that was linked in and is gone: said so, not "no such preset"
    name = str(model)
    if name not in PRESETS:
        if path.is_file():  # e.g. the config.json or a .safetensors file instead of their folder
            raise CheckpointError(f"{name}: a file; give the checkpoint's folder (where config.json lies)")
        raise CheckpointError(
            f"{name}: neither a checkpoint directory nor a preset ({', '.join(PRESETS)}), nor a Hub id (Org/Name)"
        )
    target = synth_cache_dir() / f"{name}-0"
    if not (target / "config.json").is_file():
        from inference.synth import synth  # tokenizer training code loads only when needed

        # Written aside then renamed, so a concurrent or interrupted run never leaves half a checkpoint.
        scratch = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        log.info("synthesising preset %s (random weights) into %s", name, target)
        synth(name, scratch, seed=0)
        try:
            scratch.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def parse_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def parse_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device: must be cpu or cuda, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but no CUDA GPU is available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: must be cpu or cuda, got {name!r}")
    return device


class StopStrings:
    """Holds back text that could be the start of a stop string; cuts before the first match (or after it)."""

    def __init__(self, stops: tuple[str, ...], included: bool = False):
        """included: the text ends after the matched stop string, not before it."""
        self.stops, self.included = stops, included
        self.longest = max(map(len, stops), default=0)
        self.pending = ""
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string matched)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [(i, -len(s)) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            at, minus_length = min(hits)  # the first match (the longest of those starting there)
            self.matched = self.pending[at : at - minus_length]
            shown, self.pending = self.pending[: at - minus_length if self.included else at], ""
            return shown, True
        cut = len(self.pending) - self._held()
        shown, self.pending = self.pending[:cut], self.pending[cut:]
        return shown, False

    def _held(self) -> int:
        """Length of the longest end of `pending` that a stop string starts with."""
        for k in range(min(len(self.pending), self.longest - 1), 0, -1):
            if any(s.startswith(self.pending[-k:]) for s in self.stops):
                return k
        return 0


class IndentStop:
    """Cuts the text before the first line indented less than `columns` (llama.cpp's n_indent; 0: off): a
    completion inside a block ends where the block does. The newline before that line is kept; a blank line
    never ends it. Holds back a line's leading whitespace until the line shows how deep it is."""

    def __init__(self, columns: int):
        self.columns = columns
        self.pending = ""  # the last newline and what follows it, while that line's depth is still unknown
        self.stopped = False  # a shallower line ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to show now, whether a shallower line began)."""
        if not self.columns:
            return text, False
        text, self.pending, shown = self.pending + text, "", []
        start = 0
        while (newline := text.find("\n", start)) >= 0:
            line = text[newline + 1 :]
            depth = len(line) - len(line.lstrip(" \t"))
            if depth == len(line) and depth < self.columns:  # only whitespace so far: wait for more
                shown.append(text[start:newline])
                self.pending = text[newline:]
                return "".join(shown), False
            if depth < self.columns and line[depth] not in "\r\n":  # a shallower line with code on it
                shown.append(text[start : newline + 1])
                self.stopped = True
                return "".join(shown), True
            shown.append(text[start : newline + 1])
            start = newline + 1
        shown.append(text[start:])
        return "".join(shown), False


def cut_text(stops: StopStrings, indent: IndentStop, text: str, last: bool = False) -> tuple[str, bool]:
    """(what of the decoded `text` to show now, whether the reply stops): the stop strings, then the
    indentation rule over what they let through; `last`: nothing follows, so nothing is held back."""
    text, by_string = stops.push(text)
    if last and not by_string:
        text += stops.pending
    text, by_indent = indent.push(text)
    if (last or by_string) and not by_indent:  # what the indentation rule held back preceded the end
        text += indent.pending
        indent.pending = ""
    return text, by_string or by_indent


def why_it_ended(
    finish: str, stops: StopStrings, indent: IndentStop, produced: list[int], asked: frozenset[int]
) -> tuple[str, str | int | None]:
    """(Done.ended_by, Done.stop_reason) of a generation that finished with `finish`, its filters as they ended
    and the tokens it produced. The indentation rule reads only the text before a stop string's match, so when
    both stopped it, it cut first; a stop string cuts the text before a stop token of the request's ends it."""
    if finish != "stop":
        return finish, None
    if indent.stopped:
        return "indent", None
    if stops.matched is not None:
        return "stop_string", stops.matched
    if produced and produced[-1] in asked:
        return "stop_token", produced[-1]
    return "eos", None


# generation_config.json's keys that are a request's sampling defaults (as vLLM reads them, do_sample aside):
# max_new_tokens is the length of a request that gives no max_tokens (under the server's cap)
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens")


def sampling_defaults(path: Path | None) -> dict:
    """The sampling settings the checkpoint's generation_config.json recommends (Qwen3's temperature 0.6,
    top_k 20, top_p 0.95; a max_new_tokens): the API's defaults for a request that leaves them out, as vLLM's. A
    value no request could give (a top_p of 0, a negative top_k, a max_new_tokens of 0) is left out, with a
    warning."""
    if path is None:
        return {}
    generation = read_json_file(Path(path) / "generation_config.json")
    defaults = {}
    for key in GENERATION_DEFAULT_KEYS:
        if generation.get(key) is None:
            continue
        try:
            SamplingParams(**{key: generation[key]})
            if key == "temperature" and generation[key] > MAX_API_TEMPERATURE:
                raise InvalidRequest(key, f"must be in [0, {MAX_API_TEMPERATURE:g}] (the API's range)")
        except InvalidRequest as exc:
            log.warning("%s: generation_config.json's %s left out: %s", path, key, exc.message)
            continue
        defaults[key] = generation[key]
    return defaults


class Engine:
    def __init__(self, name: str, path: Path, config: ModelConfig, tokenizer: Tokenizer, model: Transformer,
                 runner, max_context: int):  # fmt: skip
        self.name, self.path, self.config, self.tokenizer = name, path, config, tokenizer
        self.sampling_defaults = sampling_defaults(path)
        self.model, self.runner, self.max_context = model, runner, max_context
        # sized after the runner: from what its weights, buffers and graphs left free
        self.prefix = PrefixCache.sized(runner.cache)
        self.fim = find_fim_tokens(tokenizer)  # None: the checkpoint cannot fill in the middle
        self.token_names = TokenNames(tokenizer)
        self._logprob_runner: ReferenceRunner | None = None
        self.device, self.dtype = model.tok_embeddings.device, model.tok_embeddings.dtype
        self.peak_bandwidth_gbs = peak_bandwidth_gbs(self.device)
        item = self.dtype.itemsize
        # A decode step reads every weight once, except the embedding: one row (all of it when it is the head).
        embedding_rows = config.vocab_size if config.tie_word_embeddings else 1
        self._weight_bytes_per_token = (
            sum(p.numel() * item for n, p in model.named_parameters() if n != "tok_embeddings")
            + embedding_rows * config.hidden_size * item
        )

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        device: str | None = None,
        dtype: str | None = None,
        max_context: int | None = None,
        progress: Progress | None = None,
    ) -> Engine:
        # `model`: a checkpoint folder, a Hub id, a preset, or any as `name=...` (served under that name);
        # `progress`: a Hub download's (bytes done, total)
        model = model or DEFAULT_MODEL
        name = served_name(model)
        path = resolve_model(model_source(model), progress)
        config = ModelConfig.from_hf(path)
        tokenizer = Tokenizer.from_dir(path)
        check_tokenizer_fits(path, tokenizer, config.vocab_size)
        torch_device = parse_device(device)
        torch_dtype = parse_dtype(dtype, torch_device)
        if max_context is not None and max_context < 2:
            raise ValueError(f"max_context: must be >= 2 (a prompt token and a new one), got {max_context}")
        # The settings in the environment are checked before anything big is read or allocated.
        context = min(
            config.max_position_embeddings, env_max_context() if max_context is None else max_context
        )
        threads = cpu_threads_from_env()
        peak_bandwidth_from_env()
        fits = _MemoryStages(name, config, torch_device, torch_dtype, context)
        with fits.stage("weights"):
            weights = load_weights(path, config, torch_device, torch_dtype)
        if torch_device.type == "cpu":
            size = sum(w.numel() * w.element_size() for w in weights.values())
            torch.set_num_threads(threads or (1 if size < SMALL_MODEL_BYTES else os.cpu_count()))
        with fits.stage("model"):
            transformer = Transformer.from_weights(config, weights)
        # every id the tokenizer has may be written, its end tokens too: the limit is past the largest id, not the
        # count of ids, which is smaller where ids leave gaps
        with fits.stage("cache"):
            runner = _make_runner(transformer, context, tokenizer.max_id + 1)
        log.info(
            "loaded %s from %s on %s (%s, %s)", name, path, torch_device, torch_dtype, type(runner).__name__
        )
        return cls(name, path, config, tokenizer, transformer, runner, context)

    def bytes_per_token(self, context_len: int) -> int:
        """Bytes one decode step reads at `context_len` cached positions: weights plus K and V."""
        cfg = self.config
        kv_row = 2 * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        positions = sum(min(context_len, cfg.window(i) or context_len) for i in range(cfg.num_layers))
        return self._weight_bytes_per_token + kv_row * positions

    def encode_prompt(
        self,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        chat: bool = False,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """The prompt's ids: `prompt` as text, or (`messages`, or `chat`) rendered through the chat template,
        with `template_kwargs` as its further variables."""
        field = "prompt" if messages is None else "messages"  # what the client sent, for its errors
        if messages is not None or chat:
            if messages is None:
                if not prompt:
                    raise InvalidRequest("prompt", "must not be empty")
                messages = [{"role": "user", "content": prompt}]
            if not messages:
                raise InvalidRequest("messages", "must not be empty")
            for i, message in enumerate(messages):
                unicode_text(message["content"], f"messages[{i}].content" if field == "messages" else field)
            # The template writes BOS itself where the model expects one; the contents are text, never tokens.
            try:
                ids = self.tokenizer.encode_chat(messages, template_kwargs=template_kwargs)
            except InvalidRequest as e:
                if field == "messages":
                    raise
                raise InvalidRequest(field, e.message, e.code) from None  # the page's prompt, in its template
        else:
            if not prompt:
                raise InvalidRequest("prompt", "must not be empty")
            ids = self.tokenizer.encode_text(unicode_text(prompt, "prompt"))
        self._check_fits(ids, field)
        return ids

    def encode_fim(self, prefix: str, suffix: str) -> list[int]:
        """The ids that make the model write what goes between `prefix` and `suffix` (inference/fim.py)."""
        if self.fim is None:
            raise no_fim_error(self.name)
        ids = self.fim.prompt_ids(self.tokenizer, prefix, suffix)
        self._check_fits(ids)
        return ids

    def tokenize(
        self, prompt: str | None = None, messages: list[dict] | None = None, add_special_tokens: bool = True,
        template_kwargs: dict | None = None,
    ) -> list[int]:  # fmt: skip
        """The ids a prompt (its BOS where add_special_tokens and the model takes one) or a chat's rendered
        template is, as generation reads them; not checked against the context (the caller counts)."""
        if messages is not None:
            return self.tokenizer.encode_chat(messages, template_kwargs=template_kwargs)
        text = unicode_text(prompt or "", "prompt")
        ids = self.tokenizer.encode_text(text)
        if not add_special_tokens and self.tokenizer.add_bos and ids[:1] == [self.tokenizer.bos_id]:
            ids = ids[1:]
        return ids

    def detokenize(self, ids: list[int], field: str = "tokens") -> str:
        """`ids` as text (special tokens left out); `field`: the request's field that gave them, for a refusal."""
        limit = self.tokenizer.max_id + 1
        bad = next((i for i in ids if not (isinstance(i, int) and 0 <= i < limit)), None)
        if bad is not None:
            raise InvalidRequest(
                field, f"token ids must be integers in [0, {limit}) (the model's vocabulary), got {bad!r}"
            )
        return self.tokenizer.decode(ids)

    def logprob_runner(self):
        """The runner for a request with logprobs: the main one where it serves them (the reference runner, the
        lanes runner), else a reference runner on the same weights (its own KV cache, made at first use), which
        reads the whole head in PyTorch every step where the fast path would screen it or fuse the draw into the
        head."""
        if getattr(self.runner, "serves_logprobs", False):
            return self.runner
        if self._logprob_runner is None:
            log.info("%s: building the reference runner for requests with logprobs", self.name)
            self._logprob_runner = ReferenceRunner(self.model, self.max_context, self.tokenizer.max_id + 1)
        return self._logprob_runner

    def _check_fits(self, prompt_ids: list[int], field: str = "prompt") -> None:
        if not prompt_ids:
            raise InvalidRequest(field, "must not be empty")
        if len(prompt_ids) >= self.max_context:
            model_context = self.config.max_position_embeddings
            # A cap below the model's own (KOG_MAX_CONTEXT bounds the KV cache) is the server's, not the model's.
            whose = (
                f"this server's cap; the model takes {model_context}"
                if model_context > self.max_context
                else ""
            )
            raise InvalidRequest(
                field,
                f"{len(prompt_ids)} tokens do not fit the {self.max_context}-token context "
                f"(prompt plus at least one new token{'; ' + whose if whose else ''})",
                code="context_length_exceeded",
            )

    @staticmethod
    def speculation_counts(runner, tokens: int) -> SpeculationCounts:
        """The current generation's steps and drafts after `tokens` tokens; a runner that does not speculate
        took one step per token after the first."""
        counts = getattr(runner, "counts", None)
        return counts if counts is not None else SpeculationCounts(decode_steps=max(tokens - 1, 0))

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        should_stop: Callable[[], bool] | None = None,
        extra_stop_ids: frozenset[int] = frozenset(),
    ) -> Iterator[Event]:
        """Prefilled, then one TextDelta per token (its text may be empty), then exactly one Done.
        `extra_stop_ids`: tokens that end this generation besides the model's end tokens (a FIM middle's)."""
        start = time.perf_counter()
        self._check_fits(prompt_ids)
        if not all(0 <= i < self.config.vocab_size for i in prompt_ids):
            raise InvalidRequest("prompt", f"token ids must be in [0, {self.config.vocab_size})")
        if params.prompt_logprobs is not None and not getattr(self.runner, "scores_prompts", True):
            raise InvalidRequest("prompt_logprobs", "(logprobs with echo) a model split over several GPUs does "
                                 "not score its prompt's tokens")  # fmt: skip
        params = replace(
            params, max_new_tokens=min(params.max_new_tokens, self.max_context - len(prompt_ids))
        )
        asked = frozenset(params.stop_token_ids)  # the request's own: their text is part of the reply
        if any(i >= self.config.vocab_size for i in asked):
            raise InvalidRequest("stop_token_ids", f"token ids must be in [0, {self.config.vocab_size})")
        # the model's end tokens and the tokenizer's eos_token, unless ignored
        stop_ids = (frozenset() if params.ignore_eos else self.tokenizer.stop_ids) | extra_stop_ids | asked
        decoder = self.tokenizer.stream_decoder(prompt_ids)
        stops = StopStrings(params.stop, included=params.include_stop_str_in_output)
        indent = IndentStop(params.n_indent)
        shown: list[str] = []
        token_times: list[float] = []
        finish, stop_matched = "length", False

        runner = self.runner if params.logprobs is None else self.logprob_runner()
        # rows [0, cached) of the main runner's KV cache already hold this prompt's start: only the rest is
        # prefilled (a request with logprobs on a GPU runs on its own runner and cache: no reuse)
        reuses = runner is self.runner
        cached = self.prefix.begin(prompt_ids) if reuses else 0
        produced: list[int] = []
        scored = None
        if params.prompt_logprobs is not None:  # its own forward over the prompt: the runner keeps one row
            lps = prompt_logprobs(self.model, prompt_ids, params.prompt_logprobs, self.tokenizer.max_id + 1)
            scored = prompt_entries(self.token_names, prompt_ids, lps)
        # a prediction is read only where drafts are made; cut to the context, which bounds the drafter's index
        drafts = params.logprobs is None and getattr(getattr(runner, "speculation", None), "enabled", False)
        text = params.prediction if drafts else ""
        prediction = tuple(self.tokenizer.encode_text(text, bos=False)[: self.max_context]) if text else ()
        tokens = runner.generate_tokens(prompt_ids, params, stop_ids, start=cached, prediction=prediction)
        try:
            for token in tokens:
                now = time.perf_counter() - start
                if not token_times:
                    yield Prefilled(prompt_tokens=len(prompt_ids), prefill_ms=runner.last_prefill_ms,
                                    cached_tokens=cached, prompt_logprobs=scored)  # fmt: skip
                produced.append(token)
                token_times.append(now)
                spec = self.speculation_counts(runner, len(token_times))
                counts = (spec.decode_steps, spec.draft_n, spec.draft_n_accepted)
                ends = token in stop_ids
                if ends and token not in asked:
                    finish = "stop"
                    yield TextDelta("", [token], now, *counts)
                    break
                text, stop_matched = cut_text(stops, indent, decoder.push(token))
                shown.append(text)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = [delta_entry(self.token_names, token, *runner.last_logprobs)]
                yield TextDelta(text, [token], now, *counts, logprobs)
                if stop_matched or ends:
                    finish = "stop"
                    break
                if should_stop is not None and should_stop():
                    finish = "cancelled"
                    break
        finally:
            tokens.close()  # frees the runner at once, even when our caller stops iterating
            # every token but the last was fed back in, so its keys and values are in the cache
            if produced and reuses:
                self.prefix.written(prompt_ids + produced[:-1])

        if not stop_matched:  # what the decoder and the stop-string filter still hold is part of the text
            tail, stop_matched = cut_text(stops, indent, decoder.flush(), last=True)
            if stop_matched and finish == "length":
                finish = "stop"
            if tail:
                shown.append(tail)
                yield TextDelta(tail, [], time.perf_counter() - start)

        total_ms = (time.perf_counter() - start) * 1e3
        context_len = len(prompt_ids) + len(token_times)
        spec = self.speculation_counts(runner, len(token_times))
        stats = Stats(
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(token_times),
            prefill_ms=runner.last_prefill_ms,
            cached_tokens=cached,
            ttft_ms=token_times[0] * 1e3 if token_times else total_ms,
            decode_tok_s=decode_tok_s(token_times),
            total_ms=total_ms,
            token_times=token_times,
            bytes_per_token=self.bytes_per_token(context_len),
            peak_bandwidth_gbs=self.peak_bandwidth_gbs,
            decode_steps=spec.decode_steps,
            draft_n=spec.draft_n,
            draft_n_accepted=spec.draft_n_accepted,
            prediction_tokens=len(prediction),
            prediction_draft_n=spec.prediction_draft_n,
            prediction_draft_n_accepted=spec.prediction_draft_n_accepted,
        )
        ended_by, stop_reason = why_it_ended(finish, stops, indent, produced, asked)
        yield Done(finish, "".join(shown), stats, ended_by=ended_by, stop_reason=stop_reason)


class _MemoryStages:
    """Turns an allocation the device refuses while loading into one LoadOutOfMemory line: what was being
    allocated (the weights, the model's RoPE tables, the KV cache), its size, and what to lower."""

    def __init__(
        self, name: str, config: ModelConfig, device: torch.device, dtype: torch.dtype, context: int
    ):
        self.name, self.config, self.device, self.dtype, self.context = name, config, device, dtype, context

    @contextlib.contextmanager
    def stage(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            if not is_memory_error(exc):
                raise
            raise LoadOutOfMemory(self.message(what, exc)) from None

    def message(self, what: str, exc: Exception) -> str:
        cfg, item = self.config, self.dtype.itemsize
        dtype = str(self.dtype).removeprefix("torch.")
        weights_gib = sum(math.prod(s) for s in checkpoint_shapes(cfg).values()) * item / 2**30
        cache_gib = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.context * item / 2**30
        if what == "weights":
            doing = f"loading the weights ({weights_gib:.2f} GiB in {dtype})"
            fix = "load it in a smaller dtype (KOG_DTYPE=bfloat16) or on a device with more memory"
        elif what == "model":
            doing = f"building its RoPE tables for max_position_embeddings={cfg.max_position_embeddings} positions"
            fix = "check max_position_embeddings in its config.json"
        else:
            # the runner: its KV cache, and on a GPU the fused weight copies, the head's int8 screen, the graphs
            doing = (
                f"building the decode runner: its KV cache for {self.context} tokens ({cache_gib:.2f} GiB in "
                f"{dtype}), fused weight copies and CUDA graphs"
            )
            fix = "lower KOG_MAX_CONTEXT (the KV cache is sized for it) or use a device with more memory"
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"{self.name}: out of {self.device.type} memory while {doing}: {fix} ({cause})"


def forced_backend() -> str:
    """KOG_BACKEND: 'reference' or 'fast' when set, '' for the default (fast on a GPU)."""
    forced = os.environ.get("KOG_BACKEND", "").strip()
    if forced not in ("", "reference", "fast"):
        raise ValueError(f"KOG_BACKEND: must be reference or fast, got {forced!r}")
    return forced


def _make_runner(model: Transformer, max_context: int, vocab_limit: int):
    """The fast CUDA runner on a GPU when it supports the model, else the reference runner.
    KOG_BACKEND=reference|fast forces one (fast on the CPU runs its kernels in Triton's interpreter)."""
    forced = forced_backend()
    on_gpu = model.tok_embeddings.device.type == "cuda"
    if forced == "fast" or (not forced and on_gpu):
        try:
            from inference.fast import FastRunner, supports

            why = supports(model.cfg)
        except ImportError as e:
            why = f"its imports ({e})"
        if why is None:
            runner = FastRunner(model, max_context, vocab_limit)
            # the residual at the fastest of a few addresses, timed once (inference/fast/residual_placement.py)
            if on_gpu:
                runner.place_residual()
            return runner
        if forced == "fast":
            raise ValueError(f"KOG_BACKEND=fast: the fast path does not support {why}")
        log.warning("fast path unavailable for this model (%s); using the reference runner", why)
    return ReferenceRunner(model, max_context, vocab_limit)
