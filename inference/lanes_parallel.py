"""One request on several devices: a Laneformer's lanes divided among processes (docs/laneformer.md; a Llama or
Qwen as lanes summed at every block, which is tensor parallelism: parallel_config).

Each process (rank r of P) holds lanes [r*L/P, (r+1)*L/P): their slices of every matrix, their copies of the
residual stream and their KV heads, so attention and the matrix products never leave the process. What
crosses processes is the cross-lane sum of each block's partials. With the delayed reduction a lane's layer
i needs the other lanes' partials of layer i - d only: each layer's local sum is all-reduced asynchronously
as soon as it exists and waited on d layers later, so the exchange overlaps d layers of work. Layers i < d
with early communication need their own sum at once (a blocking all-reduce). The head is split by
vocabulary: every rank normalises its lanes, the lane mean is all-reduced, and each rank produces its share
of the logits (for greedy decoding only each share's best (value, id) is exchanged).

The math is inference/model.py's, lane for lane, so greedy tokens equal the one-device model's wherever the
top two logits are further apart than the different order of the fp32 sums. The exchange has two transports
(inference/lanes_exchange.py): torch.distributed's collectives (gloo on the CPU, NCCL with one GPU a process),
or peer mailboxes in GPU memory written through CUDA IPC and signalled by flags in the data (several processes
on one GPU, or one process a GPU with peer access). `spawn_lanes` starts the processes on one machine.
"""

from __future__ import annotations

import math
import os
import queue
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from inference.checkpoint import checkpoint_entries, checkpoint_tensors, load_weights
from inference.config import ModelConfig
from inference.lanes_exchange import CollectiveExchange, MailboxSpec, PeerExchange
from inference.model import Block, KVCache, Transformer, rms_norm, rope_pairs

# The rows a peer mailbox holds per exchange: a prompt longer than this is prefilled in pieces of this many.
PEER_CHUNK = 128


def parallel_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config `cfg`'s model runs as on `world` processes: a Laneformer's own; a Llama or Qwen as `world`
    lanes summed at every block (broadcast_delay 0), which is tensor parallelism: each lane a 1/world share of the
    heads, the KV heads and the MLP columns, every lane a copy of the residual stream, so each lane's stream is
    the one-lane model's up to the order of the sums."""
    if cfg.model_type == "laneformer_tp":
        return cfg
    for name, count in (("attention heads", cfg.num_heads), ("key/value heads", cfg.num_kv_heads),
                        ("MLP columns", cfg.intermediate_size)):  # fmt: skip
        if count % world:
            raise ValueError(f"{world} processes cannot share the {count} {name} of this {cfg.model_type}")
    return replace(cfg, num_lanes=world, broadcast_delay=0, use_comm=True, use_early_comm=True)


def parallel_model(model: Transformer, world: int) -> Transformer:
    """The whole `model` as parallel_config's lanes for `world` processes (a Laneformer as it is): its weights
    read back as its checkpoint and converted again with the new lane count."""
    cfg = parallel_config(model.cfg, world)
    if cfg == model.cfg:
        return model
    tensors = checkpoint_tensors(model)
    device, dtype = model.tok_embeddings.device, model.tok_embeddings.dtype
    return Transformer.from_weights(cfg, {e.internal: e.convert(tensors[e.name]).to(device, dtype).contiguous()
                                          for e in checkpoint_entries(cfg)})  # fmt: skip


def check_lanes_divide(cfg: ModelConfig, world: int) -> None:
    if cfg.num_lanes % world:
        raise ValueError(f"{world} processes cannot share {cfg.num_lanes} lanes evenly")
    if cfg.lm_head_type != "replicate":
        raise ValueError(
            f"lm_head_type {cfg.lm_head_type!r}: the lanes run apart with a replicated head only"
        )


def lane_slice_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's share of `world`: its lanes, their heads, KV heads and MLP columns."""
    return replace(cfg, num_lanes=cfg.num_lanes // world, num_heads=cfg.num_heads // world,
                   num_kv_heads=cfg.num_kv_heads // world, intermediate_size=cfg.intermediate_size // world)  # fmt: skip


def load_lane_slices(path, cfg: ModelConfig, rank: int, world: int, device: torch.device,
                     dtype: torch.dtype) -> Transformer:  # fmt: skip
    """Rank `rank` of `world`'s lanes of the checkpoint in `path` (the embedding and the head whole): what
    LaneShard(model, rank, world, ..., cfg=cfg) runs, with 1/world of the checkpoint's per-lane bytes read."""
    check_lanes_divide(cfg, world)
    per_rank = cfg.num_lanes // world
    lanes = slice(rank * per_rank, (rank + 1) * per_rank)
    return Transformer.from_weights(
        lane_slice_config(cfg, world), load_weights(path, cfg, device, dtype, lanes)
    )


class LaneShard:
    """Rank `rank` of `world`'s lanes of `model`, run by forward() in step with the other ranks: every rank
    calls forward with the same ids and positions.

    Its blocks are the model's own (model.Block) over a shard config, the lanes, heads, KV heads and MLP
    columns of one rank, whose weights are views of this rank's slices: the attention and MLP math is the
    one-device model's, and only the reduction and the head know about the other ranks."""

    def __init__(self, model: Transformer, rank: int, world: int, max_len: int, transport: str = "collective",
                 chunk: int | None = None, cfg: ModelConfig | None = None):  # fmt: skip
        """model: the whole model, or (with cfg, the whole model's config) only this rank's lanes, as
        load_lane_slices reads them."""
        cfg = cfg or model.cfg
        check_lanes_divide(cfg, world)
        self.model, self.cfg, self.world = model, cfg, world
        per_rank = cfg.num_lanes // world
        self.lanes = slice(rank * per_rank, (rank + 1) * per_rank)  # of the whole model's lanes
        self.shard_cfg = lane_slice_config(cfg, world)
        if model.cfg.num_lanes not in (cfg.num_lanes, per_rank):
            raise ValueError(
                f"model: {model.cfg.num_lanes} lanes, neither the whole model's nor a rank's share"
            )
        # where this rank's lanes are in the model's per-lane tensors
        self.own = self.lanes if model.cfg.num_lanes == cfg.num_lanes else slice(0, per_rank)
        self.blocks = [self._shard_block(layer) for layer in model.layers]
        self.cache = KVCache(
            self.shard_cfg, max_len, device=model.tok_embeddings.device, dtype=model.tok_embeddings.dtype
        )  # [N, 1, KV/P, T, hd]
        self.vocab = slice(rank * cfg.vocab_size // world, (rank + 1) * cfg.vocab_size // world)
        head = model.tok_embeddings if model.lm_head is None else model.lm_head
        self.head_rows = head[self.vocab]  # [V/P, D]
        self.share_size = -(-cfg.vocab_size // world)  # the largest vocabulary share; the others padded to it
        # the most positions one forward takes (None: any); a peer mailbox holds that many rows
        self.chunk = chunk or (PEER_CHUNK if transport == "peer" else None)
        if transport == "collective":
            self.exchange = CollectiveExchange(world)
        elif transport == "peer":
            device = model.tok_embeddings.device
            self.exchange = PeerExchange(rank, world, device, {
                # slot 2i: layer i's attention sum, 2i + 1: its MLP's, 2N: the head's lane mean
                "rows": MailboxSpec(2 * cfg.num_layers + 1, (self.chunk, cfg.hidden_size), model.tok_embeddings.dtype),
                "best": MailboxSpec(1, (2,), torch.float64),  # a greedy step's (logit, id)
                "logits": MailboxSpec(1, (self.share_size,), torch.float32),
            })  # fmt: skip
        else:
            raise ValueError(f"transport: must be collective or peer, got {transport!r}")

    def _shard_block(self, layer: Block) -> Block:
        block = Block(self.shard_cfg, layer.layer, device="meta")
        lane_weights = {name: tensor[self.own] for name, tensor in layer.named_parameters()
                        if name not in ("q_norm", "k_norm")}  # fmt: skip
        shared = {
            name: getattr(layer, name) for name in ("q_norm", "k_norm") if getattr(layer, name) is not None
        }
        block.load_state_dict({**lane_weights, **shared}, strict=True, assign=True)
        return block

    def forward(self, ids: list[int], start_pos: int) -> torch.Tensor:
        """Positions start_pos ... start_pos + len(ids) - 1 through this rank's lanes; returns the normalised
        lane mean of the last position, [D] (the head's input, the same on every rank)."""
        if self.chunk is not None and len(ids) > self.chunk:  # positions are independent but for the cache
            for at in range(0, len(ids) - self.chunk, self.chunk):
                self.forward(ids[at : at + self.chunk], start_pos + at)
            done = (len(ids) - 1) // self.chunk * self.chunk
            return self.forward(ids[done:], start_pos + done)
        self.exchange.begin_step()
        cfg, model = self.cfg, self.model
        T, D = len(ids), cfg.hidden_size
        cos, sin = rope_pairs(
            model.rope_cos[start_pos : start_pos + T], model.rope_sin[start_pos : start_pos + T]
        )
        x = (
            F.embedding(torch.tensor(ids, device=model.tok_embeddings.device), model.tok_embeddings)
            .view(1, T, D)
            .expand(self.shard_cfg.num_lanes, T, D)
        )
        exchanges = ({}, {})  # per block type: layer -> what waits for its lane sum [1, T, D]
        partials = ([], [])  # per block type: this rank's raw partials by layer, [L/P, T, D]
        for i, block in enumerate(self.blocks):
            h = rms_norm(x, block.attention_norm[:, None], cfg.norm_eps)
            x = x + self._reduce(
                i, 0, block.attention(h, 1, start_pos, cos, sin, self.cache), exchanges[0], partials[0]
            )
            x = x + self._reduce(i, 1, block.mlp(rms_norm(x, block.ffn_norm[:, None], cfg.norm_eps)),
                                 exchanges[1], partials[1])  # fmt: skip
        return self._head_input(x[:, -1])

    def _reduce(
        self, layer: int, kind: int, partial: torch.Tensor, exchanges: dict, history: list
    ) -> torch.Tensor:
        """Transformer.reduce across processes: partial [L/P, T, D] -> what each of this rank's lanes adds;
        kind: 0 attention, 1 MLP."""
        cfg, L, d = self.cfg, self.cfg.num_lanes, self.cfg.broadcast_delay
        history.append(partial)
        early = layer < d
        # The lane sum of every layer that one reads: an early layer's own (at once, d = 0 too), else layer
        # i + d's (sent now, waited on then)
        needed_now = (early and cfg.use_early_comm) or (d == 0 and cfg.use_comm)
        needed_later = cfg.use_comm and d > 0 and layer + d < cfg.num_layers
        if needed_now or needed_later:
            total = partial.sum(0, keepdim=True)
            exchanges[layer] = self.exchange.reduce("rows", 2 * layer + kind, total, at_once=needed_now)
        if early:
            return exchanges[layer]() if cfg.use_early_comm else partial * math.sqrt(L)
        if not cfg.use_comm:
            return partial * math.sqrt(L)
        past_sum = exchanges.pop(layer - d)()
        return partial + (past_sum - history[layer - d])

    def _head_input(self, x: torch.Tensor) -> torch.Tensor:  # [L/P, D] -> [D]
        cfg, head_slot = self.cfg, 2 * self.cfg.num_layers
        if cfg.pre_norm_lane_agg:
            total = self.exchange.reduce("rows", head_slot, x.sum(0), at_once=True)()
            return rms_norm(total, self.model.norm[0], cfg.norm_eps)
        y = rms_norm(x, self.model.norm[self.own], cfg.norm_eps).sum(0)
        return self.exchange.reduce("rows", head_slot, y, at_once=True)() / cfg.num_lanes

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """The whole [V] fp32 logits on every rank: each computes its vocabulary share, then they are gathered."""
        share = (self.head_rows @ y).float()
        padded = torch.full((self.share_size,), float("-inf"), device=y.device)
        padded[: share.numel()] = share
        gathered = self.exchange.gather("logits", 0, padded)
        self.exchange.check()
        vocab = self.cfg.vocab_size
        sizes = [(r + 1) * vocab // self.world - r * vocab // self.world for r in range(self.world)]
        return torch.cat([g[:n] for g, n in zip(gathered, sizes, strict=True)])

    def argmax(self, y: torch.Tensor) -> int:
        """The greedy token: each rank's best (logit, id) of its share, the best of those (lowest id on ties)."""
        share = (self.head_rows @ y).float()
        best = int(share.argmax())
        mine = torch.tensor(
            [share[best].item(), float(self.vocab.start + best)], dtype=torch.float64, device=y.device
        )
        gathered = self.exchange.gather("best", 0, mine).tolist()  # [P, 2]
        self.exchange.check()
        _, negative_id = max((value, -index) for value, index in gathered)
        return int(-negative_id)


@torch.no_grad()
def greedy(shard: LaneShard, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Prefill the prompt across the ranks, then decode greedily; every rank returns the same tokens."""
    y = shard.forward(prompt, 0)
    tokens = [shard.argmax(y)]
    while len(tokens) < max_new_tokens:
        y = shard.forward(tokens[-1:], len(prompt) + len(tokens) - 1)
        tokens.append(shard.argmax(y))
    return tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# NVLink multicast stays off in every process (no multimem operations): it can take a shared host's GPUs down.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# How the processes are joined: the process group's backend and the LaneShard transport that carries the lanes.
MODES = {"gloo": ("gloo", "collective"), "nccl": ("nccl", "collective"), "peer": ("gloo", "peer")}


def rank_device(mode: str, rank: int) -> torch.device:
    """Rank r's device: the CPU over gloo; GPU r with NCCL; with peer mailboxes GPU r where there are enough,
    else the GPUs in turn (several processes sharing one)."""
    if mode == "gloo" or not torch.cuda.is_available():  # peer on the CPU: shared memory, interpreted kernels
        return torch.device("cpu")
    if mode == "nccl":
        return torch.device("cuda", rank)
    return torch.device("cuda", rank % torch.cuda.device_count())


def transport(mode: str) -> str:
    return MODES[mode][1]


def init_rank(rank: int, world: int, port: int, mode: str, timeout: timedelta | None = None) -> None:
    """Join this process to the lane group (rank `rank` of `world`, rendezvous at 127.0.0.1:`port`); `timeout`:
    how long a collective may wait (None: torch's default)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NO_MULTICAST)
    device = rank_device(mode, rank)
    if device.type == "cpu":
        torch.set_num_threads(1)  # P processes share the machine's cores
        # shared CPU tensors as named files: every other rank opens each (a passed descriptor opens once)
        torch.multiprocessing.set_sharing_strategy("file_system")
    else:
        torch.cuda.set_device(device)
    dist.init_process_group(MODES[mode][0], rank=rank, world_size=world, timeout=timeout)


def _run_rank(rank: int, world: int, port: int, mode: str, job: Callable, results) -> None:
    init_rank(rank, world, port, mode)
    try:
        results.put((rank, job(rank, world)))
    finally:
        dist.destroy_process_group()


def spawn_lanes(world: int, job: Callable[[int, int], object], mode: str = "gloo") -> list:
    """Run job(rank, world) in `world` processes joined as `mode` says (MODES: gloo, CPU tensors; nccl, rank r
    on GPU r; peer, GPU mailboxes, processes sharing GPUs where there are fewer than `world`); their results by
    rank. `job` must be picklable (a module-level function or a partial of one)."""
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {mode!r}")
    os.environ.update(NO_MULTICAST)  # inherited by the processes
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_run_rank, args=(rank, world, port, mode, job, results))
                 for rank in range(world)]  # fmt: skip
    for process in processes:
        process.start()
    # Read while they run: a result larger than the pipe's buffer holds its sender until it is read, and a rank
    # that fails leaves the others waiting in a collective.
    by_rank = {}
    while len(by_rank) < world:
        try:
            rank, value = results.get(timeout=0.5)
            by_rank[rank] = value
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in processes):
                deadline = time.monotonic() + 10.0  # the others' own ends first, to report every cause
                for process in processes:
                    process.join(timeout=max(0.0, deadline - time.monotonic()))
                    process.kill()
                failed = [p.exitcode for p in processes if p.exitcode != 0]
                raise RuntimeError(f"lane processes failed with exit codes {failed}") from None
    for process in processes:
        process.join()
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    if failed:  # a result sent, then an end that went wrong
        raise RuntimeError(f"lane processes failed with exit codes {failed}")
    return [by_rank[rank] for rank in range(world)]


def greedy_job(raw_config: dict, seed: int, prompt: list[int], max_new_tokens: int, mode: str, rank: int,
               world: int, *, chunk: int | None = None):  # fmt: skip
    """spawn_lanes' job for a synthetic model: every rank builds synth.peaked_model(config, seed) (the same
    weights everywhere, fp32; a Llama or Qwen as parallel_model's lanes), keeps its lanes and decodes greedily;
    returns the tokens and the next step's logits (a list: tensors sent between processes need their sender
    alive)."""
    from inference.config import ModelConfig
    from inference.synth import peaked_model

    model = peaked_model(ModelConfig.from_hf(raw_config), seed)
    model = parallel_model(model, world).to(rank_device(mode, rank))
    shard = LaneShard(model, rank, world, len(prompt) + max_new_tokens, transport(mode), chunk)
    tokens = greedy(shard, prompt, max_new_tokens)
    last = shard.logits(shard.forward(tokens[-1:], len(prompt) + max_new_tokens - 1))
    return tokens, last.tolist()
