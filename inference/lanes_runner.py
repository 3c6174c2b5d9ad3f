"""One model served on several GPUs (KOG_GPUS / the worker's --gpus N): its lanes divided among N processes (a
Llama or Qwen as N lanes summed at every block: tensor parallelism, lanes_parallel.parallel_config).

The worker's process is rank 0: it holds its share of the lanes, drives generation and samples. It starts N-1
follower processes (spawned, daemonic: they end with it), each reading its share of the same checkpoint onto its
device (inference/lanes_parallel.LaneShard). Every forward pass is announced by rank 0
(a broadcast of the ids and the position over the process group), then run by all ranks in step; the logits
are gathered on every rank and rank 0 samples. One job at a time, as the worker serves anyway; the page, the
API and Redis see an ordinary engine.

On GPUs the ranks exchange through peer mailboxes (rank r on GPU r, or sharing GPUs where there are fewer);
on the CPU (tests) through gloo, or peer mailboxes in shared memory with the fast backend. Prefix reuse is off: it
would copy rank 0's cache rows only.

With the fast backend (the default on GPUs, KOG_BACKEND as for one device) the prompt is prefilled as above and
the decode steps are the fast path's (inference/fast/lane_rank.py: a CUDA graph a rank, every rank computing
the same token). Rank 0 announces decode orders of up to DECODE_CHUNK steps; every rank runs exactly the steps
of an order, stopping at the same stop id, so a request that ends early (a stop string, a client gone) only
finishes its order's steps.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from common.events import SamplingParams
from inference.config import ModelConfig
from inference.fast.lane_rank import LaneRankRunner
from inference.lanes_parallel import (
    NO_MULTICAST,
    LaneShard,
    check_lanes_divide,
    free_port,
    init_rank,
    load_lane_slices,
    parallel_config,
    rank_device,
    transport,
)
from inference.logprobs import step_logprobs
from inference.model import Transformer
from inference.prefix_cache import check_prompt_span
from inference.sampling import Sampler

log = logging.getLogger("inference.lanes_runner")


# Steps a decode order announces: its broadcast and the pipeline's restart cost about one step in this many.
DECODE_CHUNK = 64


def lanes_mode(device: torch.device, fast: bool) -> str:
    """How the ranks join: peer mailboxes on GPUs and for the fast path's kernels, gloo otherwise."""
    return "gloo" if device.type == "cpu" and not fast else "peer"


@dataclass(frozen=True)
class DecodeOrder:
    """What every rank's fast runner decodes next: `steps` steps (fewer after a stop id). A request's first order
    carries its start (first token, its position, the prompt's ids) and its sampling settings (temperature, top_k,
    top_p, repetition_penalty, seed); later ones go on from where the last left every rank."""

    steps: int
    greedy: bool
    stop_ids: frozenset[int]
    start: tuple[int, int, list[int]] | None = None
    sampling: tuple[float, int, float, float, int] | None = None


def run_order(runner: LaneRankRunner, order: DecodeOrder) -> Iterator[int]:
    if order.start is not None:
        runner.start(*order.start)
    if order.sampling is not None:
        runner.set_sampling(*order.sampling)
    yield from runner.decode(order.steps, order.greedy, order.stop_ids)


def prepare_graphs(runner: LaneRankRunner) -> None:
    """On GPUs, both steps captured at start (every rank at once), so that no request waits on a capture."""
    if runner.device.type == "cuda":
        runner.graph(greedy=True)
        runner.graph(greedy=False)


def lanes_config(config: ModelConfig, gpus: int) -> ModelConfig:
    """The config the ranks run (lanes_parallel.parallel_config: a Laneformer's lanes, a Llama or Qwen as
    tensor parallelism); ValueError in the worker's words unless its lanes, heads and columns divide among
    `gpus` processes."""
    try:
        lanes = parallel_config(config, gpus)
        check_lanes_divide(lanes, gpus)
    except ValueError as e:
        raise ValueError(f"KOG_GPUS={gpus}: {e}") from None
    return lanes


# A worker waits for requests as long as it runs: so may its followers (the group's default is 30 minutes).
IDLE_FOREVER = timedelta(days=365)


def _exit_with(parent: int) -> None:
    """End this process when `parent` (the worker) is gone: a worker killed outright leaves no rank waiting."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _follow(rank: int, world: int, port: int, mode: str, path: str, dtype: torch.dtype, max_context: int,
            fast_vocab: int | None) -> None:  # fmt: skip
    """A follower rank: read this rank's lanes of the checkpoint, run every forward rank 0 announces."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    init_rank(rank, world, port, mode, IDLE_FOREVER)
    device = rank_device(mode, rank)
    config = lanes_config(ModelConfig.from_hf(Path(path)), world)
    model = load_lane_slices(Path(path), config, rank, world, device, dtype)
    shard = LaneShard(model, rank, world, max_context, transport(mode), cfg=config)
    fast = LaneRankRunner(shard, vocab_limit=fast_vocab) if fast_vocab else None
    if fast is not None:
        prepare_graphs(fast)
    with torch.inference_mode():
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            if message[0] is None:  # rank 0 is closing
                break
            kind, order = message[0]
            if kind == "decode":
                for _ in run_order(fast, order):
                    pass
            else:
                ids, pos = order
                shard.logits(shard.forward(ids, pos))
    dist.destroy_process_group()


class LanesRunner:
    """The engine's runner (as runner.ReferenceRunner: generate_tokens, cache, last_prefill_ms) for a model whose
    lanes are divided among `world` processes, this one rank 0."""

    # a request with logprobs runs here too, through the eager steps, whose logits every rank gathers
    serves_logprobs = True
    # but not a prompt's (an echo's): this process holds its own lanes only, no whole model to score it with
    scores_prompts = False

    def __init__(self, model: Transformer, cfg: ModelConfig, path: Path, max_context: int, vocab_limit: int,
                 world: int, fast: bool = False):  # fmt: skip
        """model: rank 0's lanes (load_lane_slices) of the model whose lanes config (lanes_config) is `cfg`; fast:
        decode with the fast path's kernels (inference/fast/lane_rank.py) rather than the eager step."""
        check_lanes_divide(cfg, world)
        self.device = model.tok_embeddings.device
        self.max_context, self.world = max_context, world
        self.vocab_limit = min(vocab_limit, cfg.vocab_size)
        mode = lanes_mode(self.device, fast)
        port = free_port()
        context = multiprocessing.get_context("spawn")
        self.followers = [
            context.Process(
                target=_follow,
                args=(
                    rank,
                    world,
                    port,
                    mode,
                    str(path),
                    model.tok_embeddings.dtype,
                    max_context,
                    self.vocab_limit if fast else None,
                ),  # fmt: skip
                name=f"lanes-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, world)
        ]
        os.environ.update(NO_MULTICAST)  # in the followers' environment from their start
        for follower in self.followers:
            follower.start()
        init_rank(0, world, port, mode, IDLE_FOREVER)
        self.shard = LaneShard(model, 0, world, max_context, transport(mode), cfg=cfg)
        self.fast = LaneRankRunner(self.shard, vocab_limit=self.vocab_limit) if fast else None
        if self.fast is not None:
            prepare_graphs(self.fast)
        self.cache = self.shard.cache  # rank 0's KV heads (what the prefix cache would size itself by)
        self.last_prefill_ms = 0.0
        self.last_logprobs = None
        split = "lanes" if cfg.model_type == "laneformer_tp" else "tensor-parallel shares"
        log.info("%s of %s divided among %d processes (%s, %s decode); rank 0 holds %d of the %d %s", split,
                 cfg.model_type, world, mode, "fast" if fast else "eager", model.cfg.num_lanes, cfg.num_lanes,
                 split)  # fmt: skip

    def _check_followers(self, wait_s: float = 0.0) -> None:
        """RuntimeError naming the follower ranks that have ended (waiting up to `wait_s` for a dying one)."""
        deadline = time.monotonic() + wait_s
        for follower in self.followers:
            follower.join(timeout=max(0.0, deadline - time.monotonic()))
        gone = [f"{f.name} (exit {f.exitcode})" for f in self.followers if not f.is_alive()]
        if gone:  # its lanes are lost with it: nothing can be computed until the worker restarts
            raise RuntimeError(f"lane rank {', '.join(gone)} has ended: restart this worker")

    def _logits(self, ids: list[int], pos: int) -> torch.Tensor:
        """Positions pos ... pos + len(ids) - 1 through every rank; the last one's logits [vocab_limit] fp32."""
        try:
            dist.broadcast_object_list([("forward", (ids, pos))], src=0)
            return self.shard.logits(self.shard.forward(ids, pos))[: self.vocab_limit]
        except RuntimeError:  # a connection a rank took with it: say which rank, where there is one
            self._check_followers(wait_s=2.0)
            raise

    @torch.inference_mode()
    def generate_tokens(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        start: int = 0,
        prediction: tuple[int, ...] = (),  # speeds speculative decoding up, which the ranks do not run
    ) -> Iterator[int]:
        n = len(prompt_ids)
        check_prompt_span(n, start, self.max_context)
        self._check_followers()
        budget = min(params.max_new_tokens, self.max_context - n)
        if self.fast is not None and params.logprobs is None:
            yield from self._fast_tokens(prompt_ids, params, stop_ids, start, budget)
            return
        sample = Sampler(params, self.device)
        history = list(prompt_ids)  # for the repetition penalty
        began = time.perf_counter()
        token = self._sample(sample, self._logits(prompt_ids[start:], start), history, params)
        self.last_prefill_ms = (time.perf_counter() - began) * 1e3
        pos, made = n, 0
        while True:
            yield token
            made += 1
            if token in stop_ids or made == budget:
                return
            history.append(token)
            token, pos = self._sample(sample, self._logits([token], pos), history, params), pos + 1

    def _sample(
        self, sample: Sampler, logits: torch.Tensor, history: list[int], params: SamplingParams
    ) -> int:
        """The next token from logits [vocab_limit] (and its logprobs kept where the request asks for them)."""
        token = sample(logits, history)
        if params.logprobs is not None:
            self.last_logprobs = step_logprobs(logits, token, params.logprobs)
        return token

    def _fast_tokens(self, prompt_ids: list[int], params: SamplingParams, stop_ids: frozenset[int], start: int,
                     budget: int) -> Iterator[int]:  # fmt: skip
        """generate_tokens with the fast path's decode steps on every rank, in orders of DECODE_CHUNK steps."""
        greedy = params.greedy and params.repetition_penalty == 1
        # a seed repeats its tokens; without one each request draws its own
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()))
        sampling = (params.temperature, params.top_k, params.top_p, params.repetition_penalty, seed)
        began = time.perf_counter()
        logits = self._logits(prompt_ids[start:], start)
        self.fast.set_sampling(*sampling)
        token = self.fast.first_token(logits, prompt_ids, greedy)
        self.last_prefill_ms = (time.perf_counter() - began) * 1e3
        yield token
        left, start_state = budget - 1, (token, len(prompt_ids), list(prompt_ids))
        while left > 0 and token not in stop_ids:
            order = DecodeOrder(min(DECODE_CHUNK, left), greedy, stop_ids, start_state,
                                sampling if start_state else None)  # fmt: skip
            left, start_state = left - order.steps, None
            try:
                dist.broadcast_object_list([("decode", order)], src=0)
                tokens = run_order(self.fast, order)
                try:
                    for token in tokens:
                        yield token
                finally:  # every rank runs all of an order's steps, the reader gone or not
                    for _ in tokens:
                        pass
            except RuntimeError:  # a rank gone: say which, where there is one
                self._check_followers(wait_s=2.0)
                raise

    def close(self) -> None:
        """End the followers (they also end with this process)."""
        dist.broadcast_object_list([None], src=0)
        for follower in self.followers:
            follower.join(timeout=30)
        dist.destroy_process_group()


def load_lanes_engine(model: str, device: str | None, dtype: str | None, gpus: int, progress=None):
    """engine.Engine for a MODELS / --model entry whose lanes are divided among `gpus` processes."""
    from common.names import model_source, served_name
    from inference.config import env_max_context
    from inference.engine import (
        Engine,
        check_tokenizer_fits,
        forced_backend,
        parse_device,
        parse_dtype,
        resolve_model,
    )
    from inference.prefix_cache import PrefixCache
    from inference.tokenizer import Tokenizer

    if device is not None and ":" in device:
        raise ValueError(
            f"KOG_GPUS={gpus}: rank r runs on GPU r of those visible; choose them with CUDA_VISIBLE_DEVICES, "
            f"not the device {device}"
        )
    path = resolve_model(model_source(model), progress)
    config = ModelConfig.from_hf(path)
    lanes = lanes_config(config, gpus)  # before anything big is read or started
    tokenizer = Tokenizer.from_dir(path)
    check_tokenizer_fits(path, tokenizer, config.vocab_size)
    torch_device = parse_device(device)
    torch_dtype = parse_dtype(dtype, torch_device)
    context = min(config.max_position_embeddings, env_max_context())
    fast = forced_backend() == "fast" or (not forced_backend() and torch_device.type == "cuda")
    main_device = rank_device(lanes_mode(torch_device, fast), 0)
    transformer = load_lane_slices(path, lanes, 0, gpus, main_device, torch_dtype)
    runner = LanesRunner(transformer, lanes, path, context, tokenizer.max_id + 1, gpus, fast)
    engine = Engine(served_name(model), path, config, tokenizer, transformer, runner, context)
    engine.prefix = PrefixCache.sized(runner.cache, 0)  # the followers' caches would not follow a slot's copy
    return engine
