"""Load a safetensors checkpoint (Laneformer or HF Llama/Qwen naming) into the model's internal layout.

The internal layout is documented at the top of model.py. Every tensor the config implies is checked
for presence and shape before any is loaded, and all the differences come back in one error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from inference.config import CheckpointError, ModelConfig, check_link
from inference.failures import is_memory_error

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class Entry:
    name: str  # in the checkpoint
    internal: str  # in the model's state dict
    shape: tuple[int, ...]  # in the checkpoint
    convert: Callable[[torch.Tensor], torch.Tensor]
    part: tuple[slice, ...] | None = None  # read only this part of it (a rank's lanes), else all of it


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint for `cfg` holds, with its shape (used by synth.py too)."""
    return {e.name: e.shape for e in checkpoint_entries(cfg)}


def checkpoint_tensor(entry: Entry, internal: torch.Tensor) -> torch.Tensor:
    """The checkpoint tensor of `entry` read back from the model's tensor `internal`, on the CPU.

    The conversions only move or repeat elements (the lane dim, RoPE's row order, a shared norm expanded per
    lane), so running one on the flat index of every checkpoint element says where each element lands in the
    model: the exact inverse of the loader, whatever the family, with no second copy of the layout rules."""
    size = math.prod(entry.shape)
    where = entry.convert(torch.arange(size).view(entry.shape))
    flat = torch.empty(size, dtype=internal.dtype)
    flat[where.reshape(-1)] = internal.detach().cpu().reshape(-1)
    return flat.view(entry.shape)


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model's checkpoint (checkpoint_tensor), by checkpoint name: what load_weights reads
    back into the same model."""
    state = model.state_dict()
    return {e.name: checkpoint_tensor(e, state[e.internal]) for e in checkpoint_entries(model.cfg)}


def load_weights(
    path: str | Path,
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    lanes: slice | None = None,
) -> dict[str, torch.Tensor]:
    """The validated weights of the checkpoint in `path`, in the internal layout, on `device` in `dtype`.
    lanes: only those lanes' part of every per-lane tensor is read (a Laneformer's lanes; a Llama or Qwen run as
    lanes, tensor parallelism: lanes_parallel.parallel_config), as a model of `lane_slice_config(cfg, ...)`
    holds them (the embedding and the head whole)."""
    path = Path(path)
    files = _safetensors_files(path)
    entries = checkpoint_entries(cfg, lanes)
    # A tied head may still be saved: it must then be the embedding (checked below), so it is neither needed
    # nor unexpected.
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    located: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        _check_readable(file)
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    located[name] = (file, tuple(f.get_slice(name).get_shape()))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({_one_line(e)})") from None
    # Name in our entries -> name in the file.
    stored = {name: name for name in located}
    if (
        cfg.model_type != "laneformer_tp"
        and "embed_tokens.weight" in located
        and not any(n.startswith("model.") for n in located)
    ):
        # A base model saved alone (LlamaModel, Qwen2Model: what some tools save of model.model) names its
        # tensors without the causal LM's `model.` prefix; transformers loads it all the same.
        stored = {(n if n.startswith("lm_head.") else f"model.{n}"): n for n in located}
        located = {ours: located[theirs] for ours, theirs in stored.items()}
    embedding = entries[0].name
    if cfg.tie_word_embeddings and embedding not in located and "lm_head.weight" in located:
        # Tied weights saved under the head's name only (some exporters keep that one of the pair):
        # transformers ties the embedding to it, and so do we.
        stored[embedding], located[embedding] = stored["lm_head.weight"], located["lm_head.weight"]
    _check(path, entries, located, optional)

    weights: dict[str, torch.Tensor] = {}
    handles = {}

    def read(name: str, part: tuple[slice, ...] | None = None) -> torch.Tensor:
        file = located[name][0]
        if file not in handles:
            handles[file] = safe_open(file, framework="pt")
        if part is not None:
            return handles[file].get_slice(stored[name])[part]
        return handles[file].get_tensor(stored[name])

    try:
        for e in entries:
            weights[e.internal] = e.convert(read(e.name, e.part).to(device=device, dtype=dtype)).contiguous()
        if (
            "lm_head.weight" in optional
            and stored.get("lm_head.weight", stored[embedding]) != stored[embedding]
        ):
            _check_tied_head(embedding, located, read)
    except (SafetensorError, OSError, RuntimeError) as err:
        if is_memory_error(err):  # the device's memory, not the file: the caller says what did not fit
            raise
        raise CheckpointError(f"{path}: could not read tensor data ({_one_line(err)})") from None
    finally:
        handles.clear()
    return weights


def _check_readable(file: Path) -> None:
    """safetensors' own error for a file it may not open reads as a missing one. save_pretrained writes its
    shards readable by their owner only (mode 0600), so a worker running as another user (the image's) meets
    this with a checkpoint copied in as is."""
    try:
        file.open("rb").close()
    except PermissionError:
        raise CheckpointError(
            f"{file}: not readable by this process (permission denied); let its user read it, e.g. chmod a+r"
        ) from None


def _check_tied_head(embedding: str, located: dict, read: Callable[[str], torch.Tensor]) -> None:
    """A head saved beside tied embeddings is fine when it is a copy of the embedding. When it differs,
    transformers versions disagree on which one the model uses (5 keeps the saved head, 4 the embedding), so
    the checkpoint is ambiguous and refused rather than run with a head its author may not have meant."""
    head = read("lm_head.weight")
    if located["lm_head.weight"][1] == located[embedding][1] and torch.equal(
        head, read(embedding).to(head.dtype)
    ):
        return
    raise CheckpointError(
        f"{located['lm_head.weight'][0]}: lm_head.weight differs from {embedding} while config.json "
        "field 'tie_word_embeddings' is true; set it to false to use the saved head, or remove lm_head.weight "
        "to use the embedding"
    )


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _safetensors_files(path: Path) -> list[Path]:
    """The weight files of the checkpoint in `path`, in transformers' order of preference: model.safetensors
    first, then the shards model.safetensors.index.json lists (a re-save without sharding leaves the old index
    behind, which transformers ignores beside the single file), then any other *.safetensors."""
    check_link(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    single = path / "model.safetensors"
    check_link(single)
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    check_link(index)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({_one_line(e)})") from None
        for name in names:
            check_link(path / name)
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard files that are not there: {', '.join(missing)}")
        return [path / n for n in names]
    # A LoRA adapter's weights are not the model's: left beside a merged model, they must not be read as shards.
    shards = sorted(p for p in path.glob("*.safetensors") if p.name != "adapter_model.safetensors")
    for shard in shards:
        check_link(shard)
    if shards:
        return shards
    if (path / "adapter_model.safetensors").is_file():
        raise CheckpointError(
            f"{path}: holds only a LoRA/PEFT adapter (adapter_model.safetensors), not a whole model: merge it "
            "into its base model (PEFT's merge_and_unload) and save_pretrained the result"
        )
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{path}: only pickle checkpoints found ({', '.join(pickles)}); they are refused because "
            "unpickling can run arbitrary code. Convert them to safetensors first."
        )
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


# Saved by older transformers (RoPE's frequencies as a persistent buffer); derived from config.json, so unused,
# and transformers itself ignores them on load.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The packed weights and their zero points of GPTQ and AWQ layers (AutoGPTQ, AutoAWQ, GPTQModel).
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".g_idx")


def _check(path: Path, entries: list[Entry], located: dict, optional: set[str]) -> None:
    expected = {e.name: e.shape for e in entries}
    missing = [n for n in expected if n not in located]
    unexpected = sorted(
        n for n in located if n not in expected and n not in optional and not n.endswith(IGNORED_SUFFIXES)
    )
    misshaped = [
        f"{n} {list(located[n][1])} (expected {list(s)})"
        for n, s in expected.items()
        if n in located and located[n][1] != s
    ]
    packed = sorted(n for n in located if n.endswith(QUANTIZED_SUFFIXES))
    if packed:  # GPTQ / AWQ as older tools saved them, with no quantization_config in config.json
        raise CheckpointError(
            f"{located[packed[0]][0]}: holds quantized weights ({packed[0]}); quantized checkpoints are not "
            "supported: save the model unquantized (float32, float16 or bfloat16)"
        )
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)):
        if names:
            shown = ", ".join(names[:6]) + (f", ... ({len(names) - 6} more)" if len(names) > 6 else "")
            problems.append(f"{label} {len(names)}: {shown}")
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match config.json: {'; '.join(problems)}")


def checkpoint_entries(cfg: ModelConfig, lanes: slice | None = None) -> list[Entry]:
    """Every tensor of a checkpoint of this config: its name on disk, its name in the model, its shape on disk
    and the conversion from the one to the other (lanes: the per-lane tensors cut to those lanes)."""
    if cfg.model_type == "laneformer_tp":
        return _laneformer_entries(cfg, lanes)
    return _hf_entries(cfg, lanes)


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _laneformer_entries(cfg: ModelConfig, kept: slice | None = None) -> list[Entry]:
    L, D, hd, V = cfg.num_lanes, cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    q_rows, kv_rows, ffn = cfg.heads_per_lane * hd, cfg.kv_heads_per_lane * hd, cfg.ffn_per_lane
    kept_lanes = L if kept is None else len(range(L)[kept])
    part = None if kept is None else (kept,)

    def norm(ckpt: str, internal: str, shared: bool, lanes: int = kept_lanes) -> Entry:
        # A shared scale is stored once as `.weight` [D] and expanded to one row per lane;
        # per-lane scales are stored as `.scale` [L, D].
        if shared:
            return Entry(f"{ckpt}.weight", internal, (D,), lambda t: t.expand(lanes, D))
        return Entry(f"{ckpt}.scale", internal, (L, D), _keep, part)

    def per_lane(ckpt: str, internal: str, shape: tuple[int, ...]) -> Entry:
        return Entry(ckpt, internal, shape, _keep, part)

    shared = cfg.replicated_rmsn_scale
    entries = [Entry("model.tok_embeddings.weight", "tok_embeddings", (V, D), _keep)]
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        entries += [
            norm(p + "attention_norm", q + "attention_norm", shared),
            per_lane(p + "attention.wq.weight", q + "wq", (L, q_rows, D)),
            per_lane(p + "attention.wk.weight", q + "wk", (L, kv_rows, D)),
            per_lane(p + "attention.wv.weight", q + "wv", (L, kv_rows, D)),
            per_lane(p + "attention.wo.weight", q + "wo", (L, D, q_rows)),
            norm(p + "ffn_norm", q + "ffn_norm", shared),
            per_lane(p + "feed_forward.w1.weight", q + "w1", (L, ffn, D)),
            per_lane(p + "feed_forward.w2.weight", q + "w2", (L, D, ffn)),
            per_lane(p + "feed_forward.w3.weight", q + "w3", (L, ffn, D)),
        ]
    # With pre_norm_lane_agg the final norm sees one vector (the lane sum): one lane's worth of scale.
    if cfg.pre_norm_lane_agg:
        entries.append(norm("model.norm", "norm", shared=True, lanes=1))
    else:
        entries.append(norm("model.norm", "norm", shared))
    if cfg.lm_head_type == "lane":
        entries.append(Entry("lm_head.linear.weight", "lm_head", (V, L * D), _keep))
    elif cfg.lm_head_type == "vocab_parallel":
        entries.append(Entry("lm_head.weight", "lm_head", (L, V // L, D), _keep))
    elif not cfg.tie_word_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head", (V, D), _keep))
    return entries


def rotate_half_to_interleaved(head_dim: int) -> torch.Tensor:
    """Index that reorders one head's q/k dims from HF's rotate-half RoPE layout to interleaved pairs.

    Rotate-half rotates dims (j, j + hd/2) together; interleaved rotates (2j, 2j + 1). Permuting the
    rows of wq and wk the same way leaves every q.k score unchanged.
    """
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


def _hf_entries(cfg: ModelConfig, kept: slice | None = None) -> list[Entry]:
    """A Llama/Qwen checkpoint's tensors. With num_lanes L > 1 (tensor parallelism:
    lanes_parallel.parallel_config) lane l is the l-th of L even shares of the heads, the KV heads and the MLP
    columns: rows of q, k, v, gate and up, columns of o and down; the norms are every lane's. kept: only those
    lanes' shares are read."""
    D, hd, V, F = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.intermediate_size
    H, KV, L = cfg.num_heads, cfg.num_kv_heads, cfg.num_lanes
    perm = rotate_half_to_interleaved(hd)
    chosen = range(L)[kept or slice(None)]
    lanes = len(chosen)

    def share(n: int) -> slice:  # the kept lanes' share of n rows (or columns)
        return slice(chosen.start * n // L, chosen.stop * n // L)

    def rows(ckpt: str, internal: str, shape: tuple[int, ...], rope: bool = False) -> Entry:
        """[n, ...] on disk -> [lanes, n / L, ...]; rope: q or k rows (or biases), each head's moved from
        rotate-half to interleaved RoPE pairs."""

        def convert(t: torch.Tensor) -> torch.Tensor:
            if rope:
                t = t.reshape(-1, hd, *t.shape[1:])[:, perm.to(t.device)].reshape(t.shape)
            return t.reshape(lanes, -1, *t.shape[1:])

        return Entry(ckpt, internal, shape, convert, None if kept is None else (share(shape[0]),))

    def columns(ckpt: str, internal: str, shape: tuple[int, int]) -> Entry:
        """[D, n] on disk -> [lanes, D, n / L]."""

        def convert(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(t.shape[0], lanes, -1).transpose(0, 1)

        return Entry(ckpt, internal, shape, convert, None if kept is None else (slice(None), share(shape[1])))

    def norm(ckpt: str, internal: str) -> Entry:  # [D] -> [lanes, D]: every lane's residual is normed alike
        return Entry(ckpt, internal, (D,), lambda t: t.expand(lanes, D))

    entries = [Entry("model.embed_tokens.weight", "tok_embeddings", (V, D), _keep)]
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        entries += [
            norm(p + "input_layernorm.weight", q + "attention_norm"),
            rows(p + "self_attn.q_proj.weight", q + "wq", (H * hd, D), rope=True),
            rows(p + "self_attn.k_proj.weight", q + "wk", (KV * hd, D), rope=True),
            rows(p + "self_attn.v_proj.weight", q + "wv", (KV * hd, D)),
            columns(p + "self_attn.o_proj.weight", q + "wo", (D, H * hd)),
            norm(p + "post_attention_layernorm.weight", q + "ffn_norm"),
            rows(p + "mlp.gate_proj.weight", q + "w1", (F, D)),
            columns(p + "mlp.down_proj.weight", q + "w2", (D, F)),
            rows(p + "mlp.up_proj.weight", q + "w3", (F, D)),
        ]
        if cfg.qkv_bias:
            entries += [
                rows(p + "self_attn.q_proj.bias", q + "bq", (H * hd,), rope=True),
                rows(p + "self_attn.k_proj.bias", q + "bk", (KV * hd,), rope=True),
                rows(p + "self_attn.v_proj.bias", q + "bv", (KV * hd,)),
            ]
        if cfg.qk_norm:
            entries += [
                Entry(p + "self_attn.q_norm.weight", q + "q_norm", (hd,), lambda t: t[perm.to(t.device)]),
                Entry(p + "self_attn.k_norm.weight", q + "k_norm", (hd,), lambda t: t[perm.to(t.device)]),
            ]
    entries.append(norm("model.norm.weight", "norm"))
    if not cfg.tie_word_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head", (V, D), _keep))
    return entries
