"""The fast path's decode step for one rank of a Laneformer whose lanes are divided among devices.

Rank r of P holds lanes [r L/P, (r+1) L/P): their slices of every matrix, their residual rows and their KV
heads (the cache LaneShard prefilled). Its step is the one-device runner's launches over those lanes
(inference/fast/runner.py), and where the one-device kernels read other lanes, the peer exchange
(inference/lanes_exchange.py) carries the rows between devices without the host:

    raw partials   the history [2, N, L, D] fp32 IS a mailbox: the launch that makes a rank's partials stores
                   them into the same rows of every peer's history too, and its last program raises the flag
                   (a partial summed at once is posted by its own kernel after the launch)
    delayed layer  lane_reduce_gemv's programs wait for layer i - d's flags, then read every lane's partials as
                   on one device: the exchange hides behind d layers of weight streaming
    layer i < d    (immediate sum) lane_reduce_gemv adds the rank's own partials, post, wait, and
                   lane_sum_add adds the other lanes'
    head           each rank's lanes' share of the head input is exchanged; every rank then reads the whole
                   head and computes the same token, so no token travels back to a driver

Every rank replays the same captured step with the same inputs, so every rank leaves the same token; the
rank that serves reads it from its pinned ring. A flag holds the step's epoch, which the step itself
increments on the device, so the graph replays with no host involvement.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from inference.fast.layers import LayerWeights, reduction
from inference.fast.runner import capture_graph
from inference.fast.settings import RunnerSettings
from inference.fast.speculation import LOOKAHEAD, RING
from inference.lanes_exchange import MailboxSpec, PeerExchange
from kernels import sm_count
from kernels.decode_attention import AttentionScratch, decode_attention, default_splits
from kernels.final_norm import final_norm
from kernels.lane_reduce_gemv import lane_reduce_gemv
from kernels.lane_sum_add import lane_sum_add
from kernels.lm_head import HeadScratch, lm_head
from kernels.lm_head_screen import HeadScreen, ScreenScratch, screened_argmax
from kernels.peer_post import peer_post
from kernels.peer_wait import peer_wait
from kernels.rmsnorm_gemv import rmsnorm_gemv
from kernels.sample import SampleScratch, sample_token


class LaneRankRunner:
    """Decode steps of `shard`'s lanes (an inference.lanes_parallel.LaneShard over its KV cache), in step with
    the other ranks' runners: every rank builds one at once (the exchange's set-up is collective) and replays
    the same steps."""

    @torch.no_grad()
    def __init__(self, shard, settings: RunnerSettings | None = None, vocab_limit: int | None = None):
        """settings: None resolves the defaults for a rank's lanes; vocab_limit: ids from it on are never chosen
        (padded embedding rows)."""
        model, cfg = shard.model, shard.cfg
        device, dtype = model.tok_embeddings.device, model.tok_embeddings.dtype
        self.shard, self.model, self.cfg, self.device = shard, model, cfg, device
        self.rank, self.world = shard.lanes.start // (cfg.num_lanes // shard.world), shard.world
        self.lane_start, lanes = shard.lanes.start, shard.shard_cfg.num_lanes
        n_layers, dim = cfg.num_layers, cfg.hidden_size
        if settings is None:
            settings = RunnerSettings.resolve(shard.shard_cfg, device, dtype)
            # one stream a rank: the rank's KV heads, not a lane group's, fill the GPU once
            splits = default_splits(shard.shard_cfg.num_kv_heads, sm_count(device))
            settings = replace(settings, attention_splits=splits)
        # one chain of launches a rank, every matrix in bf16 (the 12-bit forms are the one-device runner's)
        self.settings = replace(
            settings, packed=False, packed_gate_up=False, packed_lane_down=False, lane_groups=1
        )
        # the rank's blocks (its lanes' views), each layer's reduction mode that of the whole model
        self.layers = [LayerWeights.of(cfg, i, block) for i, block in enumerate(shard.blocks)]
        self.cache = shard.cache  # [N, 1, KV/P, T, hd]
        self.max_context = self.cache.max_len

        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        q_rows, kv_rows = cfg.heads_per_lane * cfg.head_dim, cfg.kv_heads_per_lane * cfg.head_dim
        self.x = zeros(lanes, dim)  # this rank's residual rows, fp32
        self.qkv = zeros(lanes, q_rows + 2 * kv_rows)
        self.attn = zeros(lanes, q_rows, dtype=dtype)
        self.h = zeros(lanes, cfg.ffn_per_lane, dtype=dtype)
        self.no_history = zeros(cfg.num_lanes, dim)  # a DELAYED launch over it adds its own partials only
        # slot b N + i: layer i's raw partials of block b (0 attention, 1 MLP), every rank's lanes in rank order;
        # "head": each rank's share of the head input
        self.exchange = PeerExchange(self.rank, self.world, device, {
            "partials": MailboxSpec(2 * n_layers, (lanes * dim,), torch.float32),
            "head": MailboxSpec(1, (dim,), torch.float32),
        })  # fmt: skip
        self.history = self.exchange.boxes["partials"].rows.view(2, n_layers, cfg.num_lanes, dim)
        self.post_counts = zeros(2 * n_layers, dtype=torch.int32)  # a slot's programs done (the folded post)
        self.head_rows = self.exchange.boxes["head"].rows[0]  # [P, D]
        self.read_later = {w.history_in for w in self.layers if w.history_in is not None}
        self.head_in = zeros(dim)
        self.vocab_limit = min(vocab_limit or cfg.vocab_size, cfg.vocab_size)
        self.head_weight = model.tok_embeddings if model.lm_head is None else model.lm_head  # [V, D]
        self.logits = zeros(cfg.vocab_size)
        self.token = zeros(1, dtype=torch.int32)
        self.pos = zeros(1, dtype=torch.int32)
        self.out_tokens = zeros(self.max_context + 1, dtype=torch.int32)
        self.seen = zeros(cfg.vocab_size, dtype=torch.bool)
        self.sampling = zeros(4)  # temperature, top_k, top_p, repetition_penalty
        self.sample_seed = zeros(1, dtype=torch.int64)
        self.sample_scratch = SampleScratch(cfg.vocab_size, device)
        self.head_scratch = HeadScratch(cfg.vocab_size, device)
        self.head_screen = HeadScreen.build(self.head_weight) if self.settings.head_screen else None
        self.screen_scratch = ScreenScratch(cfg.vocab_size, device) if self.head_screen is not None else None
        group = cfg.num_heads // cfg.num_kv_heads
        self.attn_scratch = AttentionScratch(
            shard.shard_cfg.num_kv_heads, group, cfg.head_dim, self.settings.attention_splits, device
        )
        on_gpu = device.type == "cuda"
        self.host_tokens = torch.zeros(RING, dtype=torch.int32, pin_memory=on_gpu)
        self.token_events = [torch.cuda.Event() for _ in range(RING)] if on_gpu else []
        # (greedy, exchanging) -> graph. A step that does not exchange computes wrong tokens in the time of the
        # right ones' streaming and launches: the benchmark's breakdown of a step (inference/bench/lanes_scaling.py)
        self.graphs: dict[tuple[bool, bool], torch.cuda.CUDAGraph] = {}
        self.exchanging = True

    # --- the exchange ----------------------------------------------------------------------------------

    def _post(self, box: str, slot: int, rows: torch.Tensor) -> None:
        """This rank's rows of a slot (already in its own mailbox) into every peer's, flag raised."""
        if not self.exchanging:
            return
        mailbox, P = self.exchange.boxes[box], self.world
        peer_post(rows.view(-1), mailbox.row_table, mailbox.flag_table, (slot * P + self.rank) * mailbox.row_size,
                  slot * P + self.rank, self.exchange.epoch, use_pdl=self.settings.pdl)  # fmt: skip

    def _wait(self, box: str, slot: int) -> None:
        """The stream waits (on the device) until every rank has posted the slot this step."""
        if self.exchanging:
            peer_wait(self.exchange.boxes[box].flags[slot], self.exchange.epoch, self.exchange.status,
                      use_pdl=self.settings.pdl)  # fmt: skip

    def _post_args(self, box: str, slot: int) -> tuple:
        """What a kernel that posts a slot itself takes (kernels/lane_reduce_gemv.py's post)."""
        mailbox, P = self.exchange.boxes[box], self.world
        return (mailbox.row_table, mailbox.flag_table, slot * P * mailbox.row_size, slot * P + self.rank,
                self.exchange.epoch, self.post_counts[slot : slot + 1])  # fmt: skip

    def _flags(self, box: str, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a kernel that waits for a slot itself reads: its flags [P], the epoch and the status."""
        return self.exchange.boxes[box].flags[slot], self.exchange.epoch, self.exchange.status

    def _own_rows(self, block: int, layer: int) -> torch.Tensor:  # [L/P, D] of the history
        return self.history[block, layer, self.lane_start : self.lane_start + self.x.shape[0]]

    # --- one decode step -------------------------------------------------------------------------------

    def decode_step(self, greedy: bool = True) -> None:
        """Launch one step: consumes token/pos, leaves the next token, out_tokens[pos + 1] and pos + 1 (and the
        logits unless the step is greedy through the head screen); the same on every rank."""
        cfg, eps, pdl, n_layers = self.cfg, self.cfg.norm_eps, self.settings.pdl, self.cfg.num_layers
        self.exchange.begin_step()
        for i, w in enumerate(self.layers):
            first = i == 0
            rmsnorm_gemv(self.model.tok_embeddings if first else self.x, w.wqkv, self.qkv,
                         norm_weight=w.attention_norm, eps=eps, bias=w.bqkv, token=self.token if first else None,
                         use_pdl=pdl, prefetch=self.settings.prefetch["qkv"])  # fmt: skip
            next_layer = (
                {"next_layer": (self.cache.k[i + 1, 0], self.cache.v[i + 1, 0], self.layers[i + 1].window)}
                if self.settings.attention_prefetch_next and i + 1 < n_layers
                else {}
            )
            decode_attention(self.qkv, self.cache.k[i, 0], self.cache.v[i, 0], self.pos, self.model.rope_cos,
                             self.model.rope_sin, self.attn, self.attn_scratch,
                             num_heads=self.x.shape[0] * cfg.heads_per_lane, window=w.window, q_norm=w.q_norm,
                             k_norm=w.k_norm, eps=eps, use_pdl=pdl, **next_layer)  # fmt: skip
            self._add_partials(i, 0, self.attn, w.wo)
            rmsnorm_gemv(self.x, w.w1, self.h, norm_weight=w.ffn_norm, eps=eps, weight_up=w.w3, use_pdl=pdl,
                         prefetch=self.settings.prefetch["gate_up"])  # fmt: skip
            self._add_partials(i, 1, self.h, w.w2)
        self._head(greedy)

    def _add_partials(self, i: int, block: int, act: torch.Tensor, weight: torch.Tensor) -> None:
        """Layer i's o-proj (block 0) or down-proj (1) of this rank's lanes and its reduction across all lanes."""
        mode, past = reduction(self.cfg, i)
        n_layers, first = self.cfg.num_layers, i == 0 and block == 0
        slot = block * n_layers + i
        kind = "down" if block else "o"
        # a delayed launch waits for layer i - d's flags itself (no wait kernel between it and the one before)
        wait = (
            self._flags("partials", block * n_layers + past)
            if mode == "delayed" and self.exchanging
            else None
        )
        keep = mode == "sum" or i in self.read_later
        # A partial read d layers later is posted by the launch itself (its last program raises the flags); one
        # summed at once is posted by its own kernel: there every program's count at system scope lay on the
        # critical path, and cost more than the launch it saved.
        fold = keep and mode != "sum" and self.exchanging
        post = self._post_args("partials", slot) if fold else None
        lane_reduce_gemv(act, weight, self.x, mode="scaled" if mode == "scaled" else "delayed",
                         history_out=self.history[block, i] if keep else None,
                         history_in=self.history[block, past] if mode == "delayed" else self.no_history,
                         embedding=self.model.tok_embeddings if first else None,
                         token=self.token if first else None, use_pdl=self.settings.pdl,
                         prefetch=self.settings.prefetch[kind], lane_start=self.lane_start,
                         total_lanes=self.cfg.num_lanes, wait=wait, post=post)  # fmt: skip
        if keep and post is None:
            self._post("partials", slot, self._own_rows(block, i))
        if mode == "sum" and self.exchanging:
            self._wait("partials", slot)
            lane_sum_add(self.x, self.history[block, i], self.lane_start, use_pdl=self.settings.pdl)

    def _head(self, greedy: bool) -> None:
        """The head input from every rank's share, then the whole head on every rank (the same token)."""
        cfg, eps, pdl = self.cfg, self.cfg.norm_eps, self.settings.pdl
        own = self.head_rows[self.rank]
        if cfg.pre_norm_lane_agg:
            torch.sum(self.x, 0, out=own)
        else:  # the mean of this rank's normed lanes; their mean over the ranks is the model's
            final_norm(self.x, self.model.norm[self.shard.own], own, eps=eps, use_pdl=pdl)
        self._post("head", 0, own)
        self._wait("head", 0)
        if cfg.pre_norm_lane_agg:
            final_norm(self.head_rows, self.model.norm[0], self.head_in, eps=eps, norm_of_sum=True)
        else:
            torch.mean(self.head_rows, 0, out=self.head_in)
        ring = self.host_tokens if self.device.type == "cuda" else None
        if greedy and self.head_screen is not None:
            screened_argmax(self.head_in, self.head_weight, self.head_screen, self.screen_scratch, token=self.token,
                            pos=self.pos, out_tokens=self.out_tokens, eps=eps, vocab_limit=self.vocab_limit,
                            host_ring=ring)  # fmt: skip
            return
        lm_head(self.head_in, self.head_weight, self.logits, self.head_scratch, eps=eps, greedy=greedy,
                token=self.token, pos=self.pos, out_tokens=self.out_tokens, vocab_limit=self.vocab_limit,
                host_ring=ring if greedy else None)  # fmt: skip
        if not greedy:
            sample_token(self.logits, self.seen, self.sampling, self.sample_seed, self.sample_scratch,
                         token=self.token, pos=self.pos, out_tokens=self.out_tokens, vocab_limit=self.vocab_limit,
                         host_ring=ring)  # fmt: skip

    # --- graphs and the host loop ------------------------------------------------------------------------

    def graph(self, greedy: bool, exchanging: bool = True) -> torch.cuda.CUDAGraph:
        """The step captured once (every rank at once: the capture's eager run exchanges with the peers), leaving
        token, position and outputs as they were. exchanging=False: without the posts and waits (timing only)."""
        key = (greedy, exchanging)
        if key in self.graphs:
            return self.graphs[key]
        state = (self.token, self.pos, self.out_tokens, self.seen)
        saved = [t.clone() for t in state]
        self.exchanging = exchanging
        try:  # the capture's eager call exchanges with the peers, which run theirs at the same time
            graph = capture_graph(self.device, lambda: self.decode_step(greedy))
        finally:
            self.exchanging = True
        for t, s in zip(state, saved, strict=True):
            t.copy_(s)
        self.graphs[key] = graph
        return graph

    def start(self, token: int, position: int, seen_ids: list[int] | None = None) -> None:
        """The state a prefill leaves: `token` (the first generated) at `position`, the ids seen so far."""
        self.token.fill_(token)
        self.pos.fill_(position)
        self.out_tokens[position] = token
        self.seen.zero_()
        if seen_ids:
            self.seen[torch.tensor(seen_ids + [token], device=self.device)] = True

    def first_token(self, logits: torch.Tensor, prompt_ids: list[int], greedy: bool) -> int:
        """The token after a prompt whose last logits are `logits` [vocab_limit] fp32, drawn as the one-device
        runner's prefill draws it (the sampling kernel at the prompt's last position, set_sampling's settings)."""
        if greedy:
            return int(logits[: self.vocab_limit].argmax())
        self.logits[: logits.numel()].copy_(logits)
        self.seen.zero_()
        self.seen[torch.tensor(prompt_ids, device=self.device)] = True
        self.pos.fill_(len(prompt_ids) - 1)
        sample_token(self.logits, self.seen, self.sampling, self.sample_seed, self.sample_scratch, token=self.token,
                     pos=self.pos, out_tokens=self.out_tokens, vocab_limit=self.vocab_limit)  # fmt: skip
        return int(self.token.item())

    def set_sampling(self, temperature: float, top_k: int, top_p: float, repetition_penalty: float,
                     seed: int) -> None:  # fmt: skip
        self.sampling.copy_(torch.tensor([temperature, top_k, top_p, repetition_penalty]))
        self.sample_seed.fill_(seed)

    @torch.no_grad()
    def decode(self, steps: int, greedy: bool = True, stop_ids: frozenset[int] = frozenset()):
        """Yields the next `steps` tokens (fewer after a stop id). Every rank must run the same loop: it launches
        the same steps, since every rank sees the same tokens."""
        if self.device.type != "cuda":
            for _ in range(steps):
                self.decode_step(greedy)
                self.exchange.check()
                token = int(self.token.item())
                yield token
                if token in stop_ids:
                    return
            return
        graph, pending, launched = self.graph(greedy), [], 0
        position = int(self.pos.item())
        while True:
            while launched < steps and len(pending) < LOOKAHEAD:
                graph.replay()
                at = position + 1 + launched
                self.token_events[at % RING].record()
                pending.append(at)
                launched += 1
            if not pending:
                self.exchange.check()
                return
            at = pending.pop(0)
            self.token_events[at % RING].synchronize()
            token = int(self.host_tokens[at % RING])
            yield token
            if token in stop_ids:  # the steps still queued are the same on every rank: they finish together
                self.exchange.check()
                return


def fast_greedy_job(raw_config: dict, seed: int, prompt: list[int], new_tokens: int, mode: str, rank: int,
                    world: int):  # fmt: skip
    """spawn_lanes' job (peer mode) for a synthetic model: every rank builds synth.peaked_model(config, seed) in
    fp32 (a Llama or Qwen as parallel_model's lanes), prefills its lanes (LaneShard), then decodes with a
    LaneRankRunner; returns the greedy tokens and the logits of the step after the last (a list)."""
    from inference.config import ModelConfig
    from inference.lanes_parallel import LaneShard, parallel_model, rank_device, transport
    from inference.synth import peaked_model

    with torch.no_grad():
        model = peaked_model(ModelConfig.from_hf(raw_config), seed)
        model = parallel_model(model, world).to(rank_device(mode, rank))
        shard = LaneShard(model, rank, world, len(prompt) + new_tokens + 1, transport(mode))
        runner = LaneRankRunner(shard)
        first = shard.argmax(shard.forward(prompt, 0))
        runner.start(first, len(prompt), prompt)
        tokens = [first, *runner.decode(new_tokens)]
        if runner.head_screen is not None:  # the screen leaves no logits: one step through the whole head
            runner.pos.sub_(1)
            runner.token.fill_(tokens[-2])
            runner.decode_step(greedy=False)
        return tokens[:new_tokens], runner.logits.tolist()
