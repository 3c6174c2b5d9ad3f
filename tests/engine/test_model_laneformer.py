"""The Laneformer path against a deliberately simple reference written here from docs/laneformer.md:
einsum over lanes, float64, the whole prefix recomputed for every position, no cache."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from inference.checkpoint import checkpoint_shapes, load_weights
from inference.config import ModelConfig
from inference.model import KVCache, Transformer

SEQ_LEN, PREFILL = 20, 6


def laneformer_checkpoint(path, seed=0, **overrides):
    raw = {
        "model_type": "laneformer_tp",
        "hidden_size": 32,
        "num_hidden_layers": 5,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 64,
        "vocab_size": 96,
        "num_lanes": 4,
        "broadcast_delay": 2,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "max_position_embeddings": 64,
    }
    raw.update(overrides)
    cfg = ModelConfig.from_hf(raw)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in checkpoint_shapes(cfg).items():
        noise = torch.randn(shape, generator=gen)
        tensors[name] = 1 + 0.1 * noise if "norm" in name else 0.15 * noise
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(raw))
    return raw, tensors


def reference_logits(raw: dict, w: dict, ids: list[int]) -> torch.Tensor:
    """docs/laneformer.md's forward pass, read literally. Returns [T, V] float64."""
    w = {k: v.double() for k, v in w.items()}
    L, D, H, N = raw["num_lanes"], raw["hidden_size"], raw["num_attention_heads"], raw["num_hidden_layers"]
    KV, hd, d = raw["num_key_value_heads"], D // H, raw.get("broadcast_delay", 1)
    eps, T = raw["norm_eps"], len(ids)
    replicated = raw.get("replicated_rmsn_scale", True)
    window, n_windowed = raw.get("sliding_window"), raw.get("sliding_window_n_layers", 0)

    def scale(prefix):  # [D] shared, or [L, 1, D] one per lane
        return w[prefix + ".weight"] if replicated else w[prefix + ".scale"][:, None, :]

    def rmsnorm(x, s):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * s

    freqs = 1.0 / raw["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rotation = torch.polar(
        torch.ones(T, hd // 2, dtype=torch.float64), torch.outer(torch.arange(T).double(), freqs)
    )

    def rope(t):  # [L, T, heads, hd]: pairs (0,1), (2,3), ... rotated as complex numbers
        c = torch.view_as_complex(t.reshape(*t.shape[:-1], hd // 2, 2).contiguous())
        return torch.view_as_real(c * rotation[None, :, None, :]).flatten(-2)

    def reduce(i, p, history):
        history.append(p)
        if i < d:
            return (
                p.sum(0, keepdim=True).expand_as(p) if raw.get("use_early_comm", True) else math.sqrt(L) * p
            )
        if not raw.get("use_comm", True):
            return math.sqrt(L) * p
        others = 1 - torch.eye(L, dtype=torch.float64)  # r[l] = p[i][l] + sum over m != l of p[i-d][m]
        return p + torch.einsum("lm,mtd->ltd", others, history[i - d])

    q_pos, k_pos = torch.arange(T)[:, None], torch.arange(T)[None, :]
    x = torch.stack([w["model.tok_embeddings.weight"][ids]] * L)  # [L, T, D]
    attn_history, mlp_history = [], []
    for i in range(N):
        p = f"model.layers.{i}."
        h = rmsnorm(x, scale(p + "attention_norm"))
        q = torch.einsum("ltd,lod->lto", h, w[p + "attention.wq.weight"]).reshape(L, T, H // L, hd)
        k = torch.einsum("ltd,lod->lto", h, w[p + "attention.wk.weight"]).reshape(L, T, KV // L, hd)
        v = torch.einsum("ltd,lod->lto", h, w[p + "attention.wv.weight"]).reshape(L, T, KV // L, hd)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
        scores = torch.einsum("lqhe,lkhe->lhqk", q, k) / math.sqrt(hd)
        allowed = k_pos <= q_pos
        if window is not None and (i < n_windowed or i >= N + n_windowed):
            allowed = allowed & (k_pos > q_pos - window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        heads = torch.einsum("lhqk,lkhe->lqhe", scores.softmax(-1), v).reshape(L, T, H // L * hd)
        x = x + reduce(i, torch.einsum("lto,ldo->ltd", heads, w[p + "attention.wo.weight"]), attn_history)
        h = rmsnorm(x, scale(p + "ffn_norm"))
        gate = torch.einsum("ltd,lfd->ltf", h, w[p + "feed_forward.w1.weight"])
        up = torch.einsum("ltd,lfd->ltf", h, w[p + "feed_forward.w3.weight"])
        mlp = torch.einsum(
            "ltf,ldf->ltd", torch.nn.functional.silu(gate) * up, w[p + "feed_forward.w2.weight"]
        )
        x = x + reduce(i, mlp, mlp_history)

    head = raw.get("lm_head_type", "replicate")
    if raw.get("pre_norm_lane_agg"):
        return rmsnorm(x.sum(0), w["model.norm.weight"]) @ w["lm_head.weight"].T
    y = rmsnorm(x, scale("model.norm"))
    if head == "replicate":
        return y.mean(0) @ w["lm_head.weight"].T
    if head == "lane":
        return torch.cat(list(y), dim=-1) @ w["lm_head.linear.weight"].T
    return torch.cat([y[lane] @ w["lm_head.weight"][lane].T for lane in range(L)], dim=-1)


def load_model(path) -> Transformer:
    cfg = ModelConfig.from_hf(path)
    return Transformer.from_weights(cfg, load_weights(path, cfg))


def assert_steps_match_reference(path, raw, tensors, seed=1):
    model = load_model(path)
    ids = torch.randint(
        0, raw["vocab_size"], (SEQ_LEN,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    cache = KVCache(model.cfg, max_len=SEQ_LEN)
    with torch.inference_mode():
        prefill = model(torch.tensor([ids[:PREFILL]]), 0, cache)[0]
        expected = reference_logits(raw, tensors, ids[:PREFILL])
        torch.testing.assert_close(prefill.double(), expected, rtol=1e-4, atol=1e-4)
        for t in range(PREFILL, SEQ_LEN):
            step = model(torch.tensor([[ids[t]]]), t, cache)[0, -1]
            expected = reference_logits(raw, tensors, ids[: t + 1])[-1]
            torch.testing.assert_close(step.double(), expected, rtol=1e-4, atol=1e-4, msg=f"position {t}")


@pytest.mark.parametrize("head", ["replicate", "lane", "vocab_parallel", "pre_norm_lane_agg"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("delay", [1, 2])
@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_prefill_and_decode_match_reference(tmp_path, lanes, delay, window, head):
    overrides = {"num_lanes": lanes, "broadcast_delay": delay, "lm_head_type": head}
    if head == "pre_norm_lane_agg":
        overrides.update(lm_head_type="replicate", pre_norm_lane_agg=True)
    if window is not None:
        overrides.update(sliding_window=window, sliding_window_n_layers=2)
    raw, tensors = laneformer_checkpoint(tmp_path, **overrides)
    assert_steps_match_reference(tmp_path, raw, tensors)


@pytest.mark.parametrize(
    "overrides",
    [
        {"replicated_rmsn_scale": False},
        {"replicated_rmsn_scale": False, "lm_head_type": "vocab_parallel"},
        {"replicated_rmsn_scale": False, "pre_norm_lane_agg": True},
        {"use_comm": False},
        {"use_early_comm": False},
        {"use_comm": False, "use_early_comm": False, "broadcast_delay": 1},
        {"broadcast_delay": 0},
        {"broadcast_delay": 4, "sliding_window": 3, "sliding_window_n_layers": -2},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_reduction_and_norm_variants_match_reference(tmp_path, overrides):
    raw, tensors = laneformer_checkpoint(tmp_path, **overrides)
    assert_steps_match_reference(tmp_path, raw, tensors)


def test_lanes_change_the_output(tmp_path):
    """Guard against a reference and model that agree because the lane logic is never exercised."""
    raw, tensors = laneformer_checkpoint(tmp_path, broadcast_delay=2)
    delayed = reference_logits(raw, tensors, list(range(10)))
    immediate = reference_logits({**raw, "broadcast_delay": 0}, tensors, list(range(10)))
    assert (delayed - immediate).abs().max() > 1e-2


def test_one_lane_laneformer_equals_the_llama_path(tmp_path):
    raw, tensors = laneformer_checkpoint(
        tmp_path / "lf", num_lanes=1, num_attention_heads=4, num_key_value_heads=2
    )
    hd = raw["hidden_size"] // raw["num_attention_heads"]
    # HF rotate-half rows: dims (j, j + hd/2) hold what interleaved dims (2j, 2j + 1) hold.
    to_rotate_half = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])

    def rope_rows(t):
        return t[0].reshape(-1, hd, t.shape[-1])[:, to_rotate_half].reshape(-1, t.shape[-1])

    hf = {"model.embed_tokens.weight": tensors["model.tok_embeddings.weight"]}
    hf["model.norm.weight"] = tensors["model.norm.weight"]
    hf["lm_head.weight"] = tensors["lm_head.weight"]
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = tensors[p + "attention_norm.weight"]
        hf[p + "post_attention_layernorm.weight"] = tensors[p + "ffn_norm.weight"]
        hf[p + "self_attn.q_proj.weight"] = rope_rows(tensors[p + "attention.wq.weight"])
        hf[p + "self_attn.k_proj.weight"] = rope_rows(tensors[p + "attention.wk.weight"])
        hf[p + "self_attn.v_proj.weight"] = tensors[p + "attention.wv.weight"][0]
        hf[p + "self_attn.o_proj.weight"] = tensors[p + "attention.wo.weight"][0]
        hf[p + "mlp.gate_proj.weight"] = tensors[p + "feed_forward.w1.weight"][0]
        hf[p + "mlp.up_proj.weight"] = tensors[p + "feed_forward.w3.weight"][0]
        hf[p + "mlp.down_proj.weight"] = tensors[p + "feed_forward.w2.weight"][0]
    llama = {
        k: raw[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    }
    llama |= {
        "model_type": "llama",
        "intermediate_size": raw["intermediate_size"],
        "vocab_size": raw["vocab_size"],
    }
    llama |= {"rope_theta": raw["rope_theta"], "rms_norm_eps": raw["norm_eps"], "max_position_embeddings": 64}
    (tmp_path / "llama").mkdir()
    save_file({k: v.contiguous() for k, v in hf.items()}, tmp_path / "llama" / "model.safetensors")
    (tmp_path / "llama" / "config.json").write_text(json.dumps(llama))

    ids = torch.randint(0, raw["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        lane_logits = load_model(tmp_path / "lf")(ids)
        llama_logits = load_model(tmp_path / "llama")(ids)
    torch.testing.assert_close(llama_logits, lane_logits, rtol=1e-5, atol=1e-5)


def test_batched_forward_matches_rows_and_is_differentiable(tmp_path):
    raw, _ = laneformer_checkpoint(tmp_path, sliding_window=4, sliding_window_n_layers=2)
    cfg = ModelConfig.from_hf(raw)
    model = Transformer(cfg)
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, raw["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(4))
    logits = model(ids)
    assert logits.shape == (3, 12, raw["vocab_size"])
    for row in range(3):
        torch.testing.assert_close(logits[row], model(ids[row : row + 1])[0], rtol=1e-5, atol=1e-5)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["layers.0.wq"].abs().sum() > 0 and grads["lm_head"].abs().sum() > 0


def test_bfloat16_stays_close_to_float32(tmp_path):
    laneformer_checkpoint(tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)
    ids = torch.arange(16)[None]
    with torch.inference_mode():
        full = Transformer.from_weights(cfg, load_weights(tmp_path, cfg))(ids)
        half = Transformer.from_weights(cfg, load_weights(tmp_path, cfg, dtype=torch.bfloat16))(ids)
    assert half.dtype == torch.float32  # logits always come back in fp32
    assert (half - full).abs().max() < 0.05 * full.abs().max()
