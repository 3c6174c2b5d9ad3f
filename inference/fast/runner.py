"""Batch-1 decode with the Triton kernels of `kernels/`: the runner the Engine picks on a GPU.

A decode step is five kernels a layer (model.py's math, fused):
    rmsnorm_gemv       attention norm + q|k|v of every lane (+ Qwen2 bias); layer 0 reads the embedding row
    decode_attention   q/k norm, RoPE, KV-cache write, split-KV attention
    lane_reduce_gemv   o-proj of every lane + the cross-lane reduction + the residual add
    rmsnorm_gemv       ffn norm + gate/up + SiLU
    lane_reduce_gemv   down-proj + reduction + residual add
The 12-bit kinds (docs/fast-path.md; bf16 weights held losslessly, multiplied on the tensor cores): one-lane models
read the o-proj of layers 1 on, the down-proj and a large gate/up through packed_mma_gemv (added into the residual,
or into fp32 sums the o-proj cleared, with atomics); a Laneformer its large gate/up through packed_glu_gemv (norm
and SiLU in the launch) and its delayed (or scaled) layers' down-proj through packed_lane_reduce_gemv.
Then the head: final_norm (L > 1 only) and lm_head (norm, logits, argmax, token and position bookkeeping), or for
greedy steps lm_head_screen (the same argmax from an int8 copy of the head and the candidate rows); sampled steps
at low temperatures read the screen too, until a request's logits turn out flat (inference/fast/head_choice.py).

The step reads its token and position from device buffers and leaves the next ones there, so it is captured
once as a CUDA graph and replayed per token. The host never waits on the token it is about to launch for:
it keeps LOOKAHEAD steps queued and reads finished ids from pinned memory behind an event per step.

Lane groups (Laneformer, where its weights are bf16): from the first delayed layer a lane's layer i needs the other
lanes' partials of layer i - d only, so two groups of lanes decode as independent chains of launches, one CUDA
stream each (forked and joined inside the step's graph), meeting only through those old partials.

Prefill (inference/fast/prefill.py): the reference model's math over the whole prompt (cuBLAS or few-row Triton
products, Triton attention and boundaries; graphs for short prompts). On the CPU the kernels run interpreted.

Speculative decoding (inference/speculative.py's drafts and rule, docs/speculative-decoding.md): a drafted step
runs the current token and k drafts as k+1 positions of the prefill's path (verify), then hands the decode graphs
the state plain steps would have left; without a draft the plain graph steps run as above.

Settings (inference/fast/settings.py) are resolved once from the model's shape and the device, or passed in. On a
GPU the engine then calls place_residual() (one measured choice of the residual's address).
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from common.events import SamplingParams
from inference.config import ModelConfig
from inference.fast import residual_placement
from inference.fast.head_choice import ScreenWatch
from inference.fast.layers import LaneGroup, LayerWeights, split_from
from inference.fast.prefill import forward_prompt
from inference.fast.settings import RunnerSettings
from inference.fast.speculation import LOOKAHEAD, RING, SpeculativeSteps
from inference.fast.suffix_graphs import SuffixGraphs
from inference.model import KVCache, Transformer
from inference.prefix_cache import check_prompt_span
from inference.speculative import SpeculationCounts, SpeculationSettings
from kernels.decode_attention import AttentionScratch, decode_attention
from kernels.final_norm import final_norm
from kernels.lane_reduce_gemv import lane_reduce_gemv
from kernels.lm_head import HeadScratch, lm_head
from kernels.lm_head_screen import HeadScreen, ScreenScratch, screened_argmax, screened_logits
from kernels.packed_mma_gemv import (
    MmaPackedWeight,
    fits,
    pack_glu,
    pack_mma,
    packed_glu_gemv,
    packed_lane_reduce_gemv,
    packed_mma_gemv,
    placeholder,
)
from kernels.rmsnorm_gemv import rmsnorm_gemv
from kernels.sample import SampleScratch, sample_token

LAYER_KERNELS = 5  # a layer's launches (_layer_launches): q|k|v, attention, o-proj, gate/up, down-proj
PARTIAL_KERNELS = (2, 4)  # the o-proj and down-proj: they read the other lanes' partials of layer i - d


def supports(cfg: ModelConfig) -> str | None:
    """None when the fast path can run `cfg`, else what it lacks."""
    if cfg.lm_head_type != "replicate":
        return f"lm_head_type {cfg.lm_head_type!r} (the fast path has the replicated head only)"
    return None


def capture_graph(device: torch.device, run, pool=None) -> torch.cuda.CUDAGraph:
    """run() captured as a CUDA graph, after one eager call on a side stream (every kernel compiled outside
    the capture); pool: another graph's memory pool, for graphs that never run at once and keep nothing."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # no cyclic collection inside the capture: it may destroy a dropped runner's graphs, which CUDA forbids
    # while a stream captures (the capture is then invalidated)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            run()
    finally:
        if collecting:
            gc.enable()
    return graph


class FastRunner(SpeculativeSteps):
    # No autograd while building: a model's Parameters would otherwise tie the runner's copies (the q|k|v,
    # the packed words, the head screen) to graphs that keep their temporaries (~12 GB for qwen3-1.7b's screen).
    @torch.no_grad()
    def __init__(self, model: Transformer, max_context: int, vocab_limit: int | None = None,
                 settings: RunnerSettings | None = None,
                 speculation: SpeculationSettings | None = None):  # fmt: skip
        """settings: None resolves the defaults for this model and device (RunnerSettings.resolve).
        speculation: None reads KOG_SPECULATIVE / KOG_DRAFT_MAX (SpeculationSettings.from_env)."""
        cfg = model.cfg
        if (why := supports(cfg)) is not None:
            raise ValueError(f"model: the fast path does not support {why}")
        if not 1 < max_context <= cfg.max_position_embeddings:
            raise ValueError(f"max_context: must be in (1, {cfg.max_position_embeddings}], got {max_context}")
        device, dtype = model.tok_embeddings.device, model.tok_embeddings.dtype
        if settings is None:
            settings = RunnerSettings.resolve(cfg, device, dtype)
        settings.check(cfg)
        self.model, self.cfg, self.settings = model, cfg, settings
        self.device, self.max_context = device, max_context
        # Ids past the tokenizer's vocabulary (padded embedding rows) are never chosen: nothing decodes them.
        self.vocab_limit = min(vocab_limit or cfg.vocab_size, cfg.vocab_size)
        self.last_prefill_ms = 0.0
        lanes, dim, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim

        self.layers = [LayerWeights.of(cfg, i, block) for i, block in enumerate(model.layers)]
        self.history_layers = {w.history_in for w in self.layers if w.history_in is not None}
        self.embed = model.tok_embeddings  # [V, D]
        self.head_weight = model.tok_embeddings if model.lm_head is None else model.lm_head  # [V, D]
        self.final_norm_weight = model.norm  # [L, D], or [1, D] with pre_norm_lane_agg

        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        # The static buffers every captured step reads and writes.
        q_rows, kv_rows = cfg.heads_per_lane * hd, cfg.kv_heads_per_lane * hd
        self.x = zeros(lanes, dim)  # the residual stream of every lane, fp32
        self.qkv = zeros(lanes, q_rows + 2 * kv_rows)
        self.attn = zeros(lanes, q_rows, dtype=dtype)
        self.h = zeros(lanes, cfg.ffn_per_lane, dtype=dtype)
        self.history = zeros(2, cfg.num_layers, lanes, dim) if self.history_layers else None  # raw partials
        self.head_in = zeros(dim)
        self.logits = zeros(cfg.vocab_size)
        self.token = zeros(1, dtype=torch.int32)  # the step's input token; the step leaves the next one
        self.pos = zeros(1, dtype=torch.int32)  # its position
        self.out_tokens = zeros(max_context + 1, dtype=torch.int32)  # out_tokens[p]: the token at position p
        self.seen = zeros(cfg.vocab_size, dtype=torch.bool)  # prompt + output, for the repetition penalty
        self.sampling = zeros(4)  # temperature, top_k, top_p, repetition_penalty
        self.sample_seed = zeros(1, dtype=torch.int64)  # the request's: its draws are a function of it
        self.sample_scratch = SampleScratch(cfg.vocab_size, device)
        # A screened sampled step's candidate count, at its token's slot (pinned host memory on a GPU): head_choice.
        self.host_candidates = torch.zeros(RING, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.screen_left_at: int | None = None  # generate_tokens' last request, for tests and the benchmark
        self.cache = KVCache(cfg, max_context, 1, device, dtype)
        self.glu_sums = None  # [2 F] fp32: a packed gate/up's sums (gate, then up), read by the down-proj
        self.glu_rstd = None  # [1] fp32: their norm's scalar, written by the gate/up's launch
        if settings.packed:
            self._pack_layers()
        group = cfg.num_heads // cfg.num_kv_heads
        self.attn_scratch = AttentionScratch(cfg.num_kv_heads, group, hd, settings.attention_splits, device)
        self.head_scratch = HeadScratch(cfg.vocab_size, device)
        # Greedy steps (and sampled ones at low temperatures) read the head through its int8 screen.
        self.head_screen = HeadScreen.build(self.head_weight) if settings.head_screen else None
        self.screen_scratch = ScreenScratch(cfg.vocab_size, device) if settings.head_screen else None
        self.whole = LaneGroup(0, lanes, self.layers, self.x, self.qkv, self.attn, self.h, slice(None),
                               cfg.num_heads, self.attn_scratch)  # fmt: skip
        self.groups, self.split_from = self._lane_groups(settings.lane_groups)
        if settings.packed_gate_up and lanes > 1:
            self._pack_lanes()
        self.streams = [torch.cuda.Stream(device) for _ in self.groups] if device.type == "cuda" else None
        self.group_events: dict[tuple[int, int, int], torch.cuda.Event] = {}  # (group, layer, kernel) -> done

        # (greedy, screen, steps) -> graph
        self.graphs: dict[tuple[bool, bool, int], torch.cuda.CUDAGraph] = {}
        # Prompts up to 1024 tokens replay a graph captured for the next power of two (from 64).
        self.prefill_buckets = (
            [b for b in (64, 128, 256, 512, 1024) if b < max_context] if device.type == "cuda" else []
        )
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # A prompt on the device: the index of its last position, the reused prefix's length (start), then its ids
        # (one copy from prompt_host carries all three: the same tensor on the CPU, a pinned one on a GPU).
        self.prompt_staged = zeros(max_context + 2, dtype=torch.long)
        self.prompt_last, self.prompt_start = self.prompt_staged[:1], self.prompt_staged[1:2]
        self.prompt_ids, self.prompt_host = self.prompt_staged[2:], self.prompt_staged
        if device.type == "cuda":
            self.prompt_host = torch.zeros(max_context + 2, dtype=torch.long, pin_memory=True)
            self.prompt_copied = torch.cuda.Event()
            self.host_tokens = torch.zeros(RING, dtype=torch.int32, pin_memory=True)
            self.host_ring = self.host_tokens.numpy()  # the same memory, read without a tensor per token
            self.token_events = [torch.cuda.Event() for _ in range(RING)]
        self.residual_choice, self.residual_seconds = 0, []  # place_residual's
        self.suffix_graphs = SuffixGraphs(self)  # a prompt's part after a reused prefix, by bucket
        self._init_speculation(speculation)
        self._capture_all()

    def _capture_all(self) -> None:
        """On a GPU, every graph a request can replay, so that none waits on a kernel's compile or a capture:
        greedy, sampled through the whole head, sampled through the screen (which a request may leave mid-way),
        and the prompt buckets'."""
        if self.device.type != "cuda":
            return
        self.capture(greedy=True)
        self.capture(greedy=False, screen=False)
        if self.head_screen is not None:
            self.capture(greedy=False, screen=True)
        for bucket in self.prefill_buckets:
            self.prefill_graphs[bucket] = self._capture_prefill(bucket)
        self.suffix_graphs.capture_all()
        if self.speculation.enabled:
            self.verify_graphs.capture_up_to(self.speculation.max_draft + 1)

    @torch.no_grad()
    def place_residual(self, candidates: int = residual_placement.CANDIDATES) -> list[float]:
        """Times the greedy step with the residual at `candidates` addresses and keeps the fastest, then captures
        the graphs again (inference/fast/residual_placement.py says why). The engine calls it once on a GPU.
        Returns each candidate's step time in seconds (residual_choice: the kept one's index)."""
        self.residual_seconds = residual_placement.place_residual(self, candidates)
        self._capture_all()
        return self.residual_seconds

    def use_residual(self, x: torch.Tensor) -> None:
        """x [lanes, D] fp32 becomes the residual stream: every lane group's view re-pointed, and the captured
        graphs that hold the old address dropped."""
        self.x = self.whole.x = x
        for group in self.groups:  # lane groups' views of their lanes
            group.x = x[group.start : group.stop]
        self.graphs.clear()
        self.prefill_graphs.clear()
        self.suffix_graphs.clear()
        self.verify_graphs.clear()

    def _pack_layers(self) -> None:
        """Every layer's down-proj, and the o-proj of layers 1 on, in kernels/packed_mma_gemv.py's 12-bit layout
        (the bf16 weights stay: the prefill reads them). Layer 0's o-proj stays on lane_reduce_gemv, which starts
        the residual from the token's embedding row (the packed kernel adds into a residual that is already
        there), and so does its gate/up (the packed o-proj clears the sums a packed gate/up adds into). A matrix
        not of whole 16-row tiles by 64-column chunks stays bf16, and so does a gate/up without both neighbours."""
        gate_up = self.settings.packed_gate_up
        for i, w in enumerate(self.layers):
            w.wo_packed = self._packed(w.wo[0], f"layer {i} wo") if i > 0 else None
            w.w2_packed = self._packed(w.w2[0], f"layer {i} w2")
            if gate_up and w.wo_packed is not None and w.w2_packed is not None:
                w.w13_packed = self._packed(torch.cat([w.w1[0], w.w3[0]]), f"layer {i} w1|w3")
                w.ffn_norm_bf16 = self._as_bf16(w.ffn_norm[0], f"layer {i} ffn_norm")
        if any(w.w13_packed is not None for w in self.layers):
            # the sums every packed o-proj clears (their last reader, the down-proj before it, is done)
            self.glu_sums = torch.zeros(2 * self.cfg.ffn_per_lane, device=self.device)
            self.glu_rstd = torch.zeros(1, device=self.device)

    def _pack_lanes(self) -> None:
        """A Laneformer's gate/up (pack_glu) and its delayed and scaled layers' down-proj (settings.packed_lane_down)
        in 12 bits, for the lanes that launch them: all before split_from, each group's own from there on. A lane
        of no whole chunks stays bf16; a 'sum' layer's down-proj too (one launch needs every lane's partial)."""
        for i in range(len(self.layers)):
            for group in self.groups if self.groups and i >= self.split_from else [self.whole]:
                w = group.layers[i]
                if self.settings.packed_lane_down and w.mode != "sum":  # [lanes, D, F/L] as [lanes * D, F/L]
                    w.w2_packed = self._packed(w.w2.reshape(-1, w.w2.shape[2]), f"layer {i} w2")
                f, k = w.w1.shape[1:]
                if f % 8 or not fits(2 * f, k):
                    continue
                w.w13_packed = (
                    placeholder(2 * f * w.w1.shape[0], k, self.device)
                    if self.device.type == "meta"
                    else pack_glu(self._as_bf16(w.w1, f"layer {i} w1"), self._as_bf16(w.w3, f"layer {i} w3"))
                )
                w.ffn_norm_bf16 = self._as_bf16(w.ffn_norm, f"layer {i} ffn_norm").contiguous()

    def packed_bytes(self) -> dict[tuple[int, str], int]:
        """What each packed matrix reads a step, by (layer, 'o-proj', 'gate/up' or 'down') (the benchmark's):
        summed over the lane groups that hold their own."""
        out: dict[tuple[int, str], int] = {}
        for layers in [self.layers] + [group.layers for group in self.groups]:
            for i, w in enumerate(layers):
                kinds = (("o-proj", w.wo_packed), ("gate/up", w.w13_packed), ("down", w.w2_packed))
                for kind, packed in kinds:
                    if packed is not None:
                        out[i, kind] = out.get((i, kind), 0) + packed.nbytes()
        return out

    def _packed(self, weight: torch.Tensor, name: str) -> MmaPackedWeight | None:
        """weight [N, K] packed, or None where its shape does not fit. fp32 weights (tests on the CPU) must be bf16
        values: the packing holds bf16 numbers, exactly."""
        n, k = weight.shape
        if not fits(n, k):
            return None
        if weight.device.type == "meta":
            return placeholder(n, k, weight.device)
        return pack_mma(self._as_bf16(weight, name))

    @staticmethod
    def _as_bf16(weight: torch.Tensor, name: str) -> torch.Tensor:
        """weight in bf16, refused where that is not exact (an fp32 model's weights must be bf16 values)."""
        bf16 = weight.to(torch.bfloat16)
        exact = weight.dtype == torch.bfloat16 or weight.device.type == "meta"  # nothing to compare
        if not exact and not torch.equal(bf16.to(weight.dtype), weight):
            raise ValueError(f"packed: {name} holds values bf16 cannot (a bf16 model, or packed off)")
        return bf16

    def _lane_groups(self, count: int) -> tuple[list[LaneGroup], int]:
        """`count` groups of lanes for the layers from split_from on, and that layer; ([], number of layers) for
        one group. Each group's attention takes the settings' split count, enough for its KV heads to fill the GPU."""
        cfg, n = self.cfg, len(self.layers)
        if count == 1:
            return [], n
        lanes, start_layer = cfg.num_lanes, split_from(cfg)
        per, kv, splits = lanes // count, cfg.num_kv_heads // count, self.settings.attention_splits
        group_size = cfg.num_heads // cfg.num_kv_heads
        groups = []
        for start in range(0, lanes, per):
            stop = start + per
            groups.append(LaneGroup(
                start, stop, [w.lanes(start, stop) for w in self.layers], self.x[start:stop],
                self.qkv[start:stop], self.attn[start:stop], self.h[start:stop],
                slice(start // per * kv, (start // per + 1) * kv), cfg.num_heads // count,
                AttentionScratch(kv, group_size, cfg.head_dim, splits, self.device)))  # fmt: skip
        return groups, start_layer

    # --- one decode step -------------------------------------------------------------------------------

    def decode_step(self, greedy: bool = True, screen: bool | None = None) -> None:
        """Launch one step: consumes token/pos, leaves the next token, out_tokens[pos + 1], pos + 1, and the logits
        (all but greedy steps through the head screen, which compute the token alone; sampled steps through it
        leave -inf at the rows that cannot weigh in the draw). screen: whether the head is read through its int8
        screen (None: greedy steps when the runner has one; uses_screen says when sampled steps gain by it)."""
        cfg, eps, pdl = self.cfg, self.cfg.norm_eps, self.settings.pdl
        screen = self._screen_choice(greedy, screen)
        for i in range(self.split_from):
            for launch in self._layer_launches(self.whole, i):
                launch()
        if self.groups:
            self._grouped_layers()

        if cfg.num_lanes > 1:
            final_norm(self.x, self.final_norm_weight, self.head_in, eps=eps,
                       norm_of_sum=cfg.pre_norm_lane_agg, use_pdl=pdl)  # fmt: skip
            head_x, head_norm = self.head_in, None
        else:
            head_x, head_norm = self.x[0], self.final_norm_weight[0]
        # The step's token also lands in the host's pinned ring (generate_tokens), from the head or the sampler.
        ring = self.token_ring
        if screen and greedy:  # the token without the logits
            screened_argmax(head_x, self.head_weight, self.head_screen, self.screen_scratch, token=self.token,
                            pos=self.pos, out_tokens=self.out_tokens, norm_weight=head_norm, eps=eps,
                            vocab_limit=self.vocab_limit, host_ring=ring, use_pdl=pdl)  # fmt: skip
            return
        if screen:  # the logits of the rows that can weigh in the draw, -inf elsewhere
            screened_logits(head_x, self.head_weight, self.head_screen, self.screen_scratch, self.logits,
                            seen=self.seen, params=self.sampling, norm_weight=head_norm, eps=eps,
                            vocab_limit=self.vocab_limit, candidate_ring=self.host_candidates, pos=self.pos,
                            use_pdl=pdl)  # fmt: skip
        else:
            lm_head(head_x, self.head_weight, self.logits, self.head_scratch, norm_weight=head_norm, eps=eps,
                    greedy=greedy, vocab_limit=self.vocab_limit, token=self.token, pos=self.pos,
                    out_tokens=self.out_tokens, host_ring=ring if greedy else None, use_pdl=pdl)  # fmt: skip
        if not greedy:
            self._sample_next(ring)

    def _grouped_layers(self) -> None:
        """Layers split_from .. N - 1, each lane group on its own stream. A group's o-proj / down-proj of layer i
        reads the other groups' partials of layer i - d, so it waits for those launches; nothing else crosses.
        Without streams (the interpreter) the groups run one after another, layer by layer."""
        layers = range(self.split_from, len(self.layers))
        if self.streams is None:
            for i in layers:
                for group in self.groups:
                    for launch in self._layer_launches(group, i):
                        launch()
            return
        waits = {(g, i, k): self._cross_waits(g, i, k) for g in range(len(self.groups)) for i in layers
                 for k in range(LAYER_KERNELS)}  # fmt: skip
        awaited = {key for keys in waits.values() for key in keys}
        main = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            stream.wait_stream(main)
        # Issued kernel by kernel across the groups, so that every event waited on is recorded first.
        for i in layers:
            launches = [self._layer_launches(group, i) for group in self.groups]
            for k in range(LAYER_KERNELS):
                for g, stream in enumerate(self.streams):
                    with torch.cuda.stream(stream):
                        for key in waits[g, i, k]:
                            stream.wait_event(self._event(*key))
                        launches[g][k]()
                        if (g, i, k) in awaited:
                            self._event(g, i, k).record(stream)
        for stream in self.streams:
            main.wait_stream(stream)

    def _cross_waits(self, g: int, i: int, k: int) -> list[tuple[int, int, int]]:
        """The other groups' launches (group, layer, kernel) that group g's kernel k of layer i waits for: its
        o-proj / down-proj (kernels 2 and 4) reads their partials of layer i - d (before the split the fork
        orders them)."""
        past = self.layers[i].history_in
        if k not in PARTIAL_KERNELS or past is None or past < self.split_from:
            return []
        return [(other, past, k) for other in range(len(self.groups)) if other != g]

    def _event(self, group: int, layer: int, kernel: int) -> torch.cuda.Event:
        key = (group, layer, kernel)
        if key not in self.group_events:
            self.group_events[key] = torch.cuda.Event()
        return self.group_events[key]

    def _layer_launches(self, group: LaneGroup, i: int) -> list:
        """Layer i's five launches for a group of lanes, as closures (in order)."""
        eps, w, first, settings = self.cfg.norm_eps, group.layers[i], i == 0, self.settings
        pdl, early, prefetch = settings.pdl, settings.early, settings.prefetch

        def qkv() -> None:
            rmsnorm_gemv(self.embed if first else group.x, w.wqkv, group.qkv, norm_weight=w.attention_norm, eps=eps,
                         bias=w.bqkv, token=self.token if first else None, use_pdl=pdl,
                         trigger_early="qkv" in early, prefetch=prefetch["qkv"])  # fmt: skip

        def attention() -> None:
            decode_attention(group.qkv, self.cache.k[i, 0, group.kv_heads], self.cache.v[i, 0, group.kv_heads],
                             self.pos, self.model.rope_cos, self.model.rope_sin, group.attn, group.scratch,
                             num_heads=group.num_heads, window=w.window, q_norm=w.q_norm, k_norm=w.k_norm, eps=eps,
                             use_pdl=pdl, **self._next_layer(group, i))  # fmt: skip

        def gate_up() -> None:
            # lanes: the norm, gate/up and SiLU in one launch, h as rmsnorm_gemv leaves it
            if w.w13_packed is not None and self.cfg.num_lanes > 1:
                packed_glu_gemv(group.x, w.w13_packed, group.h, w.ffn_norm_bf16, eps=eps, use_pdl=pdl,
                                trigger_early="gate_up" in early, **settings.packed_blocks["lanes_gate_up"])  # fmt: skip
                return
            # one lane: into the sums the o-proj cleared; the down-proj applies rstd and SiLU
            if w.w13_packed is not None:
                packed_mma_gemv(group.x[0], w.w13_packed, self.glu_sums, norm_weight=w.ffn_norm_bf16, eps=eps,
                                rstd=self.glu_rstd, use_pdl=pdl, trigger_early="gate_up" in early,
                                **settings.packed_blocks["gate_up"])  # fmt: skip
                return
            rmsnorm_gemv(group.x, w.w1, group.h, norm_weight=w.ffn_norm, eps=eps, weight_up=w.w3, use_pdl=pdl,
                         trigger_early="gate_up" in early, prefetch=prefetch["gate_up"])  # fmt: skip

        return [
            qkv,
            attention,
            lambda: self._add_partials(i, w, 0, group.attn, w.wo, first, group),
            gate_up,
            lambda: self._add_partials(i, w, 1, group.h, w.w2, False, group),
        ]

    def _next_layer(self, group: LaneGroup, i: int) -> dict:
        """decode_attention's next_layer argument for layer i of a group (the same KV heads one layer on)."""
        if not self.settings.attention_prefetch_next or i + 1 == len(self.layers):
            return {}
        heads = group.kv_heads
        return {"next_layer": (self.cache.k[i + 1, 0, heads], self.cache.v[i + 1, 0, heads],
                               self.layers[i + 1].window)}  # fmt: skip

    def _add_partials(self, i: int, w: LayerWeights, block: int, act: torch.Tensor, weight: torch.Tensor,
                      first: bool, group: LaneGroup) -> None:  # fmt: skip
        kind, settings, history = ("down" if block else "o"), self.settings, self.history
        packed = w.w2_packed if block else w.wo_packed
        reduce = dict(mode=w.mode, history_out=history[block, i] if i in self.history_layers else None, use_pdl=settings.pdl,
                      history_in=history[block, w.history_in] if w.history_in is not None else None, lane_start=group.start,
                      total_lanes=self.cfg.num_lanes, trigger_early=kind in settings.early)  # fmt: skip
        if packed is not None and self.cfg.num_lanes > 1:  # lanes: the reduction in the same launch
            packed_lane_reduce_gemv(act, packed, group.x, **reduce, **settings.packed_blocks["lanes_reduce"])
            return
        if packed is not None:  # one lane: out += W @ act into the residual, on the tensor cores
            # the down-proj after a packed gate/up reads its sums; the o-proj clears them (the last reader is done)
            glu = block == 1 and w.w13_packed is not None
            packed_mma_gemv(self.glu_sums if glu else act[0], packed, group.x[0], glu=act.dtype if glu else None,
                            rstd=self.glu_rstd if glu else None, zero=self.glu_sums if block == 0 else None,
                            use_pdl=settings.pdl, trigger_early=kind in settings.early,
                            **settings.packed_blocks[kind])  # fmt: skip
            return
        lane_reduce_gemv(act, weight, group.x, **reduce, embedding=self.embed if first else None,
                         token=self.token if first else None, prefetch=settings.prefetch[kind])  # fmt: skip

    def _sample_next(self, host_ring: torch.Tensor | None = None) -> None:
        """The sampled token from the logits, on the device without a host sync (kernels/sample.py: repetition
        penalty, temperature, top-k, top-p, a draw keyed by the request's seed); temperature 0 is greedy."""
        sample_token(self.logits, self.seen, self.sampling, self.sample_seed, self.sample_scratch, token=self.token,
                     pos=self.pos, out_tokens=self.out_tokens, vocab_limit=self.vocab_limit, host_ring=host_ring,
                     use_pdl=self.settings.pdl)  # fmt: skip

    # --- graphs --------------------------------------------------------------------------------------

    def capture(self, greedy: bool, steps: int = 1, screen: bool | None = None) -> torch.cuda.CUDAGraph:
        """Capture `steps` decode steps as one graph (the runner replays one),
        leaving token, position and outputs as they were. screen: as decode_step's."""
        key = (greedy, self._screen_choice(greedy, screen), steps)
        if key in self.graphs:
            return self.graphs[key]

        def run() -> None:
            for _ in range(steps):
                self.decode_step(greedy, key[1])

        with self.step_state_kept():
            graph = self._graph_of(run)
        self.graphs[key] = graph
        return graph

    @contextmanager
    def step_state_kept(self) -> Iterator[None]:
        """Steps taken inside (a capture's eager run, the residual's timing) leave the token, the position, the
        outputs and the seen ids as they found them."""
        state = (self.token, self.pos, self.out_tokens, self.seen)
        saved = [t.clone() for t in state]
        yield
        for t, s in zip(state, saved, strict=True):
            t.copy_(s)

    def _screen_choice(self, greedy: bool, screen: bool | None) -> bool:
        """decode_step's `screen`: None is greedy steps when the runner has a screen; True needs one."""
        if screen and self.head_screen is None:
            raise ValueError("screen: this runner was built without the head screen (settings.head_screen)")
        return greedy and self.head_screen is not None if screen is None else screen

    def uses_screen(self, params: SamplingParams) -> bool:
        """Whether generate_tokens reads the head through the screen for these settings: greedy steps whenever the
        runner has one; sampled steps up to sampled_screen_temperature, where the rows within reach of the draw
        are few (models/default at 0.2: 12 of 8,192 a step, median; at 0.5: 1,309, and the screen plus those
        rows would cost about what the whole head does)."""
        if self.head_screen is None:
            return False
        return params.greedy or params.temperature <= self.settings.screen_sampled_temperature

    @property
    def token_ring(self) -> torch.Tensor | None:
        """The host's pinned ring the step's last kernel writes its token into (on a GPU; None on the CPU)."""
        return self.host_tokens if self.device.type == "cuda" else None

    def _candidates(self, position: int) -> int:
        """The rows a screened sampled step read again in bf16, by the position of the token it drew (that token's
        slot of the ring; the step has finished)."""
        return int(self.host_candidates[position % RING])

    def _leaves_screen(self, watch: ScreenWatch, position: int) -> bool:
        """Feeds `watch` the count of the step that drew position's token; True, with screen_left_at set, when the
        request leaves the screen."""
        if watch.keeps_screen(self._candidates(position)):
            return False
        self.screen_left_at = position
        return True

    def _graph_of(self, run, pool=None) -> torch.cuda.CUDAGraph:
        return capture_graph(self.device, run, pool)

    def step(self, greedy: bool = True, screen: bool | None = None) -> None:
        """One decode step: a graph replay on CUDA, eager kernels under the interpreter."""
        if self.device.type == "cuda":
            self.capture(greedy, screen=screen).replay()
        else:
            self.decode_step(greedy, screen)

    # --- the runner contract -------------------------------------------------------------------------

    @torch.no_grad()
    def forward_prompt(
        self, ids: torch.Tensor, last: torch.Tensor, start: int | torch.Tensor = 0
    ) -> torch.Tensor:
        """model.forward over a prompt ids [T] at positions start .. start + T - 1 into the cache (rows before
        start already hold the prompt's first ids); the logits [V] at row last [1] of ids."""
        return forward_prompt(self.model, self.layers, self.cache, self.attn_scratch, ids, last, start,
                              pdl=self.settings.pdl)  # fmt: skip

    def _capture_prefill(self, bucket: int) -> torch.cuda.CUDAGraph:
        """forward_prompt over the first `bucket` positions of prompt_ids as a graph: prompts up to the bucket
        are padded after their end, which causal attention never lets the real positions see."""
        return self._graph_of(
            lambda: self.logits.copy_(self.forward_prompt(self.prompt_ids[:bucket], self.prompt_last))
        )

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int], greedy: bool = True, start: int = 0) -> None:
        """The prompt into the cache; leaves the first token in token/out_tokens and pos = len(prompt_ids),
        exactly as a decode step would. Short prompts replay a captured graph (their launches would otherwise
        cost more than their arithmetic). start > 0: the cache's rows [0, start) hold the prompt's first ids
        already (inference/prefix_cache.py); the rest replays a suffix graph (inference/fast/suffix_graphs.py)
        where one fits, else is prefilled eagerly."""
        n = len(prompt_ids)
        check_prompt_span(n, start, self.max_context)
        self._stage_prompt(prompt_ids, start)
        ids = self.prompt_ids[:n]
        bucket = next((b for b in self.prefill_buckets if b >= n), None)
        suffix_graph = self.suffix_graphs.for_suffix(n - start, start) if start else None
        if suffix_graph is not None:
            suffix_graph.replay()
        elif start:
            self.logits.copy_(self.forward_prompt(ids[start:], self.prompt_last - start, start))
        elif bucket is None:
            self.logits.copy_(self.forward_prompt(ids, self.prompt_last))
        else:
            if bucket not in self.prefill_graphs:
                self.prefill_graphs[bucket] = self._capture_prefill(bucket)
            self.prefill_graphs[bucket].replay()
        self.seen.zero_()
        self.seen.index_fill_(0, ids, True)
        self.pos.fill_(n - 1)
        if greedy:
            token = self.logits[: self.vocab_limit].argmax().to(torch.int32).view(1)
            self.token.copy_(token)
            self.out_tokens[n : n + 1].copy_(token)
            self.pos.add_(1)
        else:
            # with the ring, as the step graphs call it: the same compiled kernels, none built on a first request
            self._sample_next(self.token_ring)

    def _stage_prompt(self, prompt_ids: list[int], start: int = 0) -> None:
        """[n - 1, start, ids...] into prompt_staged, without waiting for the GPU. The host is the limit at a long
        prompt's start (its kernels each finish before the next is queued), so this is one write into a pinned
        buffer through numpy (much faster than torch.tensor of a list) and one asynchronous copy, where a
        Python scalar or list written into a device tensor would be a pageable copy that synchronizes the stream."""
        n, on_gpu, vocab = len(prompt_ids), self.device.type == "cuda", self.embed.shape[0]
        if on_gpu:
            self.prompt_copied.synchronize()  # the previous prompt has left the pinned buffer
        staged = self.prompt_host.numpy()
        staged[0], staged[1], ids = n - 1, start, staged[2 : n + 2]
        try:
            ids[:] = prompt_ids
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"prompt_ids: expected token ids (ints), got {type(e).__name__}: {e}") from None
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompt_ids: token ids must be in [0, {vocab}), got {ids.min()} .. {ids.max()}")
        if on_gpu:
            self.prompt_staged[: n + 2].copy_(self.prompt_host[: n + 2], non_blocking=True)
            self.prompt_copied.record()

    def generate_tokens(self, prompt_ids: list[int], params: SamplingParams, stop_ids: frozenset[int] = frozenset(),
                        start: int = 0, prediction: tuple[int, ...] = ()) -> Iterator[int]:  # fmt: skip
        """Token ids after the prompt, the first from prefill (from position start: see prefill); stops after a
        stop id or max_new_tokens (clipped to the context). prediction: more tokens to draft from (SuffixDrafter)."""
        budget = min(params.max_new_tokens, self.max_context - len(prompt_ids))
        greedy = params.greedy and params.repetition_penalty == 1
        screen = self.uses_screen(params)
        # sampled steps through the screen report their candidates; flat logits send the request to the whole head
        sampled_screen = screen and not greedy
        watch = ScreenWatch(self.cfg.vocab_size, self.settings.screen_leave_share) if sampled_screen else None
        self.screen_left_at = None  # the position whose step's count made this request leave the screen
        self.counts = SpeculationCounts() if self.speculation.enabled else None
        self.sampling.copy_(torch.tensor([params.temperature, params.top_k, params.top_p,
                                          params.repetition_penalty]))  # fmt: skip
        # A seed repeats its tokens; without one each request draws its own (from torch's CPU generator).
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()))
        self.sample_seed.fill_(seed)
        began = time.perf_counter()
        self.prefill(prompt_ids, greedy, start)
        first = int(self.token.item())
        self.last_prefill_ms = (time.perf_counter() - began) * 1e3
        yield first
        if first in stop_ids or budget <= 1:
            return
        if self.speculation.enabled:
            yield from self._speculative_decode(
                prompt_ids, first, budget, greedy, screen, watch, stop_ids, prediction
            )
            return
        if self.device.type != "cuda":
            for step in range(1, budget):
                self.decode_step(greedy, screen)
                token = int(self.token.item())
                position = len(prompt_ids) + step
                if watch is not None and self._leaves_screen(watch, position):
                    screen, watch = False, None
                yield token
                if token in stop_ids:
                    return
            return

        graph = self.capture(greedy, screen=screen)  # captured when the runner was built
        pending: deque[int] = deque()  # positions whose tokens are on their way
        launched = 1
        while True:
            # Keep the GPU LOOKAHEAD steps ahead of the caller; it never waits for the host.
            while launched < budget and len(pending) < LOOKAHEAD:
                graph.replay()
                # the step's last kernel (head or sampler) wrote position p's token at slot p % RING
                position = len(prompt_ids) + launched
                self.token_events[position % RING].record()
                pending.append(position)
                launched += 1
            if not pending:
                return
            position = pending.popleft()
            self.token_events[position % RING].synchronize()
            token = int(self.host_ring[position % RING])
            # steps already queued keep the screen; those launched from here on read the whole head (its graph
            # exists: the switch waits on no capture)
            if watch is not None and self._leaves_screen(watch, position):
                graph, watch = self.capture(greedy, screen=False), None
            yield token
            if token in stop_ids:
                return
