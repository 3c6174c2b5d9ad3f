"""The reference Transformer in plain PyTorch: one model for Laneformer (L lanes) and Llama/Qwen (L = 1).

It is the yardstick every faster path is checked against, and the model train.py trains.

Internal weight layout (what checkpoint.load_weights returns, what Transformer's state dict holds,
what the fast path reads as is). L lanes, N layers, D hidden, H / KV heads, hd head dim, F ffn, V vocab.

    tok_embeddings              [V, D]
    layers.{i}.attention_norm   [L, D]            RMSNorm scale per lane (a shared scale is copied L times)
    layers.{i}.wq               [L, H/L*hd, D]    lane l -> query heads l*H/L ... (l+1)*H/L - 1
    layers.{i}.wk, wv           [L, KV/L*hd, D]   lane l -> KV heads l*KV/L ...
    layers.{i}.wo               [L, D, H/L*hd]    lane l's heads -> lane l's partial D-vector
    layers.{i}.bq               [L, H/L*hd]       qwen2 only, with bk, bv [L, KV/L*hd]
    layers.{i}.q_norm, k_norm   [hd]              qwen3 only: RMSNorm of each head before RoPE
    layers.{i}.ffn_norm         [L, D]
    layers.{i}.w1, w3           [L, F/L, D]       gate, up
    layers.{i}.w2               [L, D, F/L]       down
    norm                        [L, D]            [1, D] with pre_norm_lane_agg (it normalises the lane sum)
    lm_head                     replicate [V, D] | lane [V, L*D] | vocab_parallel [L, V/L, D];
                                absent when tied: the head is tok_embeddings

Heads are lane-major everywhere (head j of lane l is global head l*H/L + j), so flattening [L, H/L]
gives HF's head order. q/k rows are in the interleaved-pair RoPE layout: dims (2j, 2j+1) of a head
rotate together. HF rotate-half checkpoints are permuted into it at load time
(checkpoint.rotate_half_to_interleaved), so the model, its cache and any kernel know one layout.
A Llama-family model is L = 1.

Buffers: rope_cos, rope_sin [max_position_embeddings, hd/2] fp32, cos/sin(position * inv_freq[j])
for pair j (the configured scaling applied; YaRN's attention factor multiplies both).
KV cache: k, v [N, B, KV, max_len, hd], keys stored after RoPE, preallocated once.
Activations are [L, B*T, D]: each lane carries its own copy of the residual stream, and every
projection is one batched matmul over the lane dimension.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from inference.config import LinearRopeScaling, ModelConfig, YarnRopeScaling


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        max_len: int,
        batch_size: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [N, B, KV, max_len, hd]
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequency of each rotated pair, [hd/2] fp32, with the configured scaling (linear, YaRN, Llama 3)."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if isinstance(s, LinearRopeScaling):  # positions divided by factor: the same as frequencies divided by it
        return inv_freq / s.factor
    if isinstance(s, YarnRopeScaling):
        return _yarn_inv_freq(cfg, s)
    # Llama 3: long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(cfg: ModelConfig, s: YarnRopeScaling) -> torch.Tensor:
    """YaRN: pairs that turn more than beta_fast times over the original context keep their frequency, pairs
    that turn fewer than beta_slow times are slowed down by `factor`, and the pairs between are blended
    linearly in the pair index."""
    hd, theta = cfg.head_dim, cfg.rope_theta
    wavelengths_per_2pi = theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)
    kept, slowed = 1.0 / wavelengths_per_2pi, 1.0 / (s.factor * wavelengths_per_2pi)

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
        return (
            hd * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = pair_turning(s.beta_fast), pair_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(hd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return slowed * ramp + kept * (1 - ramp)


def rope_tables(
    cfg: ModelConfig, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, [max_pos, hd/2] fp32 each (shapes only on the meta device)."""
    if device is not None and torch.device(device).type == "meta":
        # no arithmetic on meta: its decompositions import torch._dynamo, which then holds every live process
        # group past destroy_process_group (a rank's gloo threads would outlive it and abort its exit)
        shape = (cfg.max_position_embeddings, cfg.head_dim // 2)
        return torch.empty(shape, device="meta"), torch.empty(shape, device="meta")
    positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
    angles = torch.outer(positions, rope_inv_freq(cfg))  # [max_pos, hd/2]
    cos, sin = angles.cos(), angles.sin()
    if isinstance(cfg.rope_scaling, YarnRopeScaling):
        # YaRN scales q and k (so every score by its square) through the tables, as transformers does: the
        # fast path's kernels read these same tables, so they need nothing of their own.
        factor = cfg.rope_scaling.attention_factor
        cos, sin = cos * factor, sin * factor
    return cos.to(device), sin.to(device)


def rope_pairs(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, hd/2] tables -> [T, hd] ones for apply_rope: (c0, c0, c1, c1, ...) and (-s0, s0, -s1, s1, ...)."""
    return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs in fp32: x [..., T, hd], cos/sin [T, hd] from rope_pairs.

    (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin): x * cos plus x with each pair swapped * sin.
    """
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos + swapped * sin).type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalised in fp32, cast back, then scaled: the order HF's Llama RMSNorm uses.
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def attention_mask(
    q_start: int, q_len: int, k_start: int, k_len: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[q_len, k_len] bool: query at q_start + t sees keys at positions p - W + 1 ... p (causal if W is None)."""
    q = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    k = torch.arange(k_start, k_start + k_len, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def head_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, D] times the head weight [V, D] transposed: logits [M, V]. For a few rows (a speculative verify
    step's k+1) the CPU's GEMM runs several times slower as x @ W^T than as (W @ x^T)^T; one row or many keep
    x @ W^T."""
    if 1 < x.shape[0] <= 32 and x.device.type == "cpu":
        return (weight @ x.T).T
    return x @ weight.T


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, device=None, dtype=None):
        super().__init__()
        L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
        q_rows, kv_rows, ffn = cfg.heads_per_lane * hd, cfg.kv_heads_per_lane * hd, cfg.ffn_per_lane

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))

        self.cfg, self.layer, self.window = cfg, layer, cfg.window(layer)
        self.attention_norm = param(L, D)
        self.wq, self.wk, self.wv = param(L, q_rows, D), param(L, kv_rows, D), param(L, kv_rows, D)
        self.wo = param(L, D, q_rows)
        self.bq = self.bk = self.bv = self.q_norm = self.k_norm = None
        if cfg.qkv_bias:
            self.bq, self.bk, self.bv = param(L, q_rows), param(L, kv_rows), param(L, kv_rows)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = param(hd), param(hd)
        self.ffn_norm = param(L, D)
        self.w1, self.w3, self.w2 = param(L, ffn, D), param(L, ffn, D), param(L, D, ffn)

    def attention(
        self,
        h: torch.Tensor,  # [L, B*T, D], normalised
        batch: int,
        start_pos: int,
        cos: torch.Tensor,  # [T, hd], rope_pairs
        sin: torch.Tensor,
        cache: KVCache | None,
    ) -> torch.Tensor:  # lane partials [L, B*T, D]
        cfg, L = self.cfg, self.cfg.num_lanes
        T = h.shape[1] // batch
        q, k, v = (
            torch.bmm(h, self.wq.mT),
            torch.bmm(h, self.wk.mT),
            torch.bmm(h, self.wv.mT),
        )  # [L, B*T, H/L*hd], [L, B*T, KV/L*hd]
        if self.bq is not None:
            q, k, v = q + self.bq[:, None], k + self.bk[:, None], v + self.bv[:, None]
        q, k, v = (self._heads(t, batch, T) for t in (q, k, v))  # [B, H, T, hd], [B, KV, T, hd]
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, cfg.norm_eps), rms_norm(k, self.k_norm, cfg.norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        k_start = start_pos
        if cache is not None:
            end = start_pos + T
            cache.k[self.layer, :, :, start_pos:end] = k
            cache.v[self.layer, :, :, start_pos:end] = v
            k_start = 0 if self.window is None else max(0, start_pos - self.window + 1)
            k, v = cache.k[self.layer, :, :, k_start:end], cache.v[self.layer, :, :, k_start:end]
        # One new token sees every cached key it was given (the window is in k_start); a causal
        # square block without a window needs no mask; anything else gets an explicit one.
        mask, causal = None, False
        if T > 1 and self.window is None and k_start == start_pos:
            causal = True
        elif T > 1:
            mask = attention_mask(start_pos, T, k_start, k.shape[2], self.window, h.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=cfg.num_heads != cfg.num_kv_heads
        )  # [B, H, T, hd]
        out = out.unflatten(1, (L, -1)).permute(1, 0, 3, 2, 4).reshape(L, batch * T, -1)
        return torch.bmm(out, self.wo.mT)

    def _heads(self, x: torch.Tensor, batch: int, T: int) -> torch.Tensor:
        # [L, B*T, n*hd] -> [B, L*n, T, hd]: lane-major heads
        L, hd = self.cfg.num_lanes, self.cfg.head_dim
        return x.view(L, batch, T, -1, hd).permute(1, 0, 3, 2, 4).flatten(1, 2)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:  # [L, B*T, D] -> lane partials [L, B*T, D]
        return torch.bmm(F.silu(torch.bmm(h, self.w1.mT)) * torch.bmm(h, self.w3.mT), self.w2.mT)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        L, D, V = cfg.num_lanes, cfg.hidden_size, cfg.vocab_size
        self.tok_embeddings = nn.Parameter(torch.empty(V, D, device=device, dtype=dtype))
        self.layers = nn.ModuleList(Block(cfg, i, device, dtype) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(
            torch.empty(1 if cfg.pre_norm_lane_agg else L, D, device=device, dtype=dtype)
        )
        head_shape = {"replicate": (V, D), "lane": (V, L * D), "vocab_parallel": (L, V // L, D)}
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(head_shape[cfg.lm_head_type], device=device, dtype=dtype))
        cos, sin = rope_tables(cfg, device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_pos, hd/2] fp32
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> Transformer:
        """Wrap loaded weights (checkpoint.load_weights) without copying them, for inference: no parameter
        requires a gradient, so nothing built from them keeps an autograd graph of its temporaries."""
        model = cls(cfg, device="meta")
        model.load_state_dict(weights, strict=True, assign=True)
        model.rope_cos, model.rope_sin = rope_tables(cfg, weights["tok_embeddings"].device)
        return model.eval().requires_grad_(False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random init for training: normal(std) matrices, the residual outputs (wo, w2) scaled down by
        sqrt(2N) so the residual stream does not grow with depth, unit norms, zero biases."""
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in leaf:
                p.fill_(1.0)
            elif leaf in ("bq", "bk", "bv"):
                p.zero_()
            else:
                scale = 1 / math.sqrt(2 * self.cfg.num_layers) if leaf in ("wo", "w2") else 1.0
                p.normal_(0.0, std * scale, generator=generator)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        start_pos: int = 0,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:  # logits [B, T, V] fp32 ([B, 1, V] with last_only)
        cfg = self.cfg
        L, D = cfg.num_lanes, cfg.hidden_size
        B, T = input_ids.shape
        cos, sin = rope_pairs(
            self.rope_cos[start_pos : start_pos + T], self.rope_sin[start_pos : start_pos + T]
        )
        x = F.embedding(input_ids, self.tok_embeddings).view(1, B * T, D).expand(L, B * T, D)
        attn_partials: list[torch.Tensor] = []
        mlp_partials: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            p = layer.attention(
                rms_norm(x, layer.attention_norm[:, None], cfg.norm_eps), B, start_pos, cos, sin, cache
            )
            x = x + self.reduce(i, p, attn_partials)
            p = layer.mlp(rms_norm(x, layer.ffn_norm[:, None], cfg.norm_eps))
            x = x + self.reduce(i, p, mlp_partials)
        if last_only:
            x, T = x.view(L, B, T, D)[:, :, -1], 1
        return self.head(x).view(B, T, -1).float()

    def reduce(self, layer: int, partial: torch.Tensor, history: list[torch.Tensor]) -> torch.Tensor:
        """What each lane adds to its residual stream from this block's lane partials [L, B*T, D].

        The delayed cross-lane sum of docs/laneformer.md, reproduced exactly (including its reading of the
        partials of layers d <= i < 2d). `history` holds this block type's raw partials of earlier layers.
        """
        cfg, L, d = self.cfg, self.cfg.num_lanes, self.cfg.broadcast_delay
        history.append(partial)
        if L == 1:
            return partial
        if layer < d:
            return partial.sum(0, keepdim=True) if cfg.use_early_comm else partial * math.sqrt(L)
        if not cfg.use_comm:
            return partial * math.sqrt(L)
        # own fresh partial + the other lanes' partials from d layers back (d = 0: the plain sum)
        past = history[layer - d]
        return partial + (past.sum(0, keepdim=True) - past)

    def head(self, x: torch.Tensor) -> torch.Tensor:  # [L, M, D] -> [M, V]
        """The logits of the residual streams x: the final norm and the head, by the model's lm_head_type."""
        cfg, L = self.cfg, self.cfg.num_lanes
        weight = self.tok_embeddings if self.lm_head is None else self.lm_head
        if cfg.pre_norm_lane_agg:
            return head_product(rms_norm(x.sum(0), self.norm, cfg.norm_eps), weight)
        y = rms_norm(x, self.norm[:, None], cfg.norm_eps)  # [L, M, D]
        if cfg.lm_head_type == "replicate":
            return head_product(y.mean(0), weight)
        if cfg.lm_head_type == "lane":  # one head over the concatenated lanes
            return head_product(y.permute(1, 0, 2).reshape(y.shape[1], L * y.shape[2]), weight)
        # vocab_parallel: lane l produces logits l*V/L ... (l+1)*V/L - 1 from its own stream
        return (y @ weight.mT).permute(1, 0, 2).reshape(y.shape[1], -1)
