"""One model served on several GPUs (KOG_GPUS / the worker's --gpus N): its lanes divided among N processes.

The worker's process is rank 0: it holds the whole model, drives generation and samples. It starts N-1
follower processes (spawned, daemonic: they end with it), each loading the same checkpoint onto its device and
keeping its share of the lanes (inference/lanes_parallel.LaneShard). Every forward pass is announced by rank 0
(a broadcast of the ids and the position over the process group), then run by all ranks in step; the logits
are gathered on every rank and rank 0 samples. One job at a time, as the worker serves anyway; the page, the
API and Redis see an ordinary engine.

On GPUs the ranks exchange through peer mailboxes (rank r on GPU r, or sharing GPUs where there are fewer);
on the CPU (tests) through gloo. Prefix reuse is off: it would copy rank 0's cache rows only.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from common.events import SamplingParams
from inference.lanes_parallel import NO_MULTICAST, LaneShard, free_port, init_rank, rank_device, transport
from inference.model import Transformer
from inference.prefix_cache import check_prompt_span
from inference.sampling import Sampler

log = logging.getLogger("inference.lanes_runner")


def lanes_mode(device: torch.device) -> str:
    return "gloo" if device.type == "cpu" else "peer"


def check_divisible(config, gpus: int) -> None:
    """ValueError unless `config` is a Laneformer whose lanes divide among `gpus` processes."""
    lanes = getattr(config, "num_lanes", 1)
    if config.model_type != "laneformer_tp" or lanes % gpus:
        raise ValueError(
            f"KOG_GPUS={gpus}: only a Laneformer whose lane count divides by {gpus} runs on several devices "
            f"({config.model_type}, {lanes} lanes)"
        )
    if config.lm_head_type != "replicate":
        raise ValueError(f"KOG_GPUS={gpus}: the lanes run apart with a replicated head only")


# A worker waits for requests as long as it runs: so may its followers (the group's default is 30 minutes).
IDLE_FOREVER = timedelta(days=365)


def _exit_with(parent: int) -> None:
    """End this process when `parent` (the worker) is gone: a worker killed outright leaves no rank waiting."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _follow(
    rank: int, world: int, port: int, mode: str, path: str, dtype: torch.dtype, max_context: int
) -> None:
    """A follower rank: load the checkpoint, keep this rank's lanes, run every forward rank 0 announces."""
    from inference.checkpoint import load_weights
    from inference.config import ModelConfig

    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    init_rank(rank, world, port, mode, IDLE_FOREVER)
    device = rank_device(mode, rank)
    config = ModelConfig.from_hf(Path(path))
    model = Transformer.from_weights(config, load_weights(Path(path), config, device, dtype))
    shard = LaneShard(model, rank, world, max_context, transport(mode))
    with torch.inference_mode():
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            if message[0] is None:  # rank 0 is closing
                break
            ids, pos = message[0]
            shard.logits(shard.forward(ids, pos))
    dist.destroy_process_group()


class LanesRunner:
    """The engine's runner (as runner.ReferenceRunner: generate_tokens, cache, last_prefill_ms) for a model whose
    lanes are divided among `world` processes, this one rank 0."""

    def __init__(self, model: Transformer, path: Path, max_context: int, vocab_limit: int, world: int):
        cfg = model.cfg
        check_divisible(cfg, world)
        self.device = model.tok_embeddings.device
        self.max_context, self.world = max_context, world
        self.vocab_limit = min(vocab_limit, cfg.vocab_size)
        mode = lanes_mode(self.device)
        port = free_port()
        context = multiprocessing.get_context("spawn")
        self.followers = [
            context.Process(
                target=_follow,
                args=(rank, world, port, mode, str(path), model.tok_embeddings.dtype, max_context),
                name=f"lanes-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, world)
        ]
        os.environ.update(NO_MULTICAST)  # in the followers' environment from their start
        for follower in self.followers:
            follower.start()
        init_rank(0, world, port, mode, IDLE_FOREVER)
        self.shard = LaneShard(model, 0, world, max_context, transport(mode))
        self.cache = self.shard.cache  # rank 0's KV heads (what the prefix cache would size itself by)
        self.last_prefill_ms = 0.0
        self.last_logprobs = None
        log.info("lanes of %s divided among %d processes (%s)", cfg.model_type, world, mode)

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
            dist.broadcast_object_list([(ids, pos)], src=0)
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
    ) -> Iterator[int]:
        n = len(prompt_ids)
        check_prompt_span(n, start, self.max_context)
        self._check_followers()
        budget = min(params.max_new_tokens, self.max_context - n)
        sample = Sampler(params, self.device)
        history = list(prompt_ids)  # for the repetition penalty
        began = time.perf_counter()
        token = sample(self._logits(prompt_ids[start:], start), history)
        self.last_prefill_ms = (time.perf_counter() - began) * 1e3
        pos, made = n, 0
        while True:
            yield token
            made += 1
            if token in stop_ids or made == budget:
                return
            history.append(token)
            token, pos = sample(self._logits([token], pos), history), pos + 1

    def close(self) -> None:
        """End the followers (they also end with this process)."""
        dist.broadcast_object_list([None], src=0)
        for follower in self.followers:
            follower.join(timeout=30)
        dist.destroy_process_group()


def load_lanes_engine(model: str, device: str | None, dtype: str | None, gpus: int, progress=None):
    """engine.Engine for a MODELS / --model entry whose lanes are divided among `gpus` processes."""
    from common.names import model_source, served_name
    from inference.checkpoint import load_weights
    from inference.config import ModelConfig, env_max_context
    from inference.engine import Engine, check_tokenizer_fits, parse_device, parse_dtype, resolve_model
    from inference.prefix_cache import PrefixCache
    from inference.tokenizer import Tokenizer

    if device is not None and ":" in device:
        raise ValueError(
            f"KOG_GPUS={gpus}: rank r runs on GPU r of those visible; choose them with CUDA_VISIBLE_DEVICES, "
            f"not the device {device}"
        )
    path = resolve_model(model_source(model), progress)
    config = ModelConfig.from_hf(path)
    check_divisible(config, gpus)  # before anything big is read or started
    tokenizer = Tokenizer.from_dir(path)
    check_tokenizer_fits(path, tokenizer, config.vocab_size)
    torch_device = parse_device(device)
    torch_dtype = parse_dtype(dtype, torch_device)
    context = min(config.max_position_embeddings, env_max_context())
    main_device = rank_device(lanes_mode(torch_device), 0)
    transformer = Transformer.from_weights(config, load_weights(path, config, main_device, torch_dtype))
    runner = LanesRunner(transformer, path, context, tokenizer.max_id + 1, gpus)
    engine = Engine(served_name(model), path, config, tokenizer, transformer, runner, context)
    engine.prefix = PrefixCache.sized(runner.cache, 0)  # the followers' caches would not follow a slot's copy
    return engine
