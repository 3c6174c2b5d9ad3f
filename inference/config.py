"""One model configuration for every family we run, read from a Hugging Face `config.json`.

A Llama-family model (llama, qwen2, qwen3) is a Laneformer with one lane: the lane fields keep their
neutral values and the family options (q/k/v bias, q/k norm, head_dim, rope scaling) switch on.
Torch-free, so the web process may validate a model directory without loading model code.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.env import env_number

MODEL_TYPES = ("laneformer_tp", "llama", "qwen2", "qwen3")
LM_HEAD_TYPES = ("replicate", "lane", "vocab_parallel")
QWEN3_HEAD_DIM = 128  # transformers' Qwen3Config default, for a config.json that leaves head_dim out


class CheckpointError(Exception):
    """A checkpoint directory the engine cannot load; the message is one line. (Defined here, torch-free, so
    that config.json's reader raises it too; inference.checkpoint exports it.)"""


def check_link(path: Path) -> None:
    """A checkpoint file that is a symbolic link to nothing is said so, not reported as missing: an HF cache
    snapshot (`models--Org--Name/snapshots/<hash>/`) holds only links into the cache's blobs/ folder, and a
    snapshot copied or mounted without it loses every file. One check for config, tokenizer and weights."""
    if path.is_symlink() and not path.exists():
        target = os.readlink(path)
        hint = ""
        if "blobs" in Path(target).parts:
            # with the cache's blobs/ folder there, this file was never (fully) downloaded, or was removed
            whole = (path.parent / target).parent.is_dir()
            hint = (
                "; its blob is missing from the cache: download the model again (hf download <org>/<name>)"
                if whole
                else "; an HF cache snapshot's files live in its cache's blobs/ folder: mount the whole "
                "models--<org>--<name> folder, or copy the snapshot with its files (cp -rL)"
            )
        raise CheckpointError(f"{path} is a broken symbolic link (to {target}){hint}")


def read_json_file(path: Path) -> dict:
    """A checkpoint's optional JSON file (tokenizer_config.json, generation_config.json, ...) as a dict, {} when
    absent; a broken link is no absent file (a snapshot that lost its blobs must not load half-read)."""
    check_link(path)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


DEFAULT_MAX_CONTEXT = 4096  # tokens; KOG_MAX_CONTEXT caps the KV cache of long-context models


def env_max_context() -> int:
    """KOG_MAX_CONTEXT (default 4096), checked as the engine's max_context argument is: an integer >= 2."""
    return int(
        env_number(
            "KOG_MAX_CONTEXT",
            DEFAULT_MAX_CONTEXT,
            "an integer >= 2 (tokens: a prompt token and a new one at least)",
            integer=True,
            minimum=2,
        )
    )


DEFAULT_PREFIX_SLOTS = 4  # saved KV caches besides the live one: a few conversations served in turn


def env_prefix_slots() -> int:
    """KOG_PREFIX_SLOTS (default 4): the most KV caches of earlier requests a runner keeps besides its live one,
    for prefix reuse (inference/prefix_cache.py); 0 turns prefix reuse off."""
    return int(
        env_number("KOG_PREFIX_SLOTS", DEFAULT_PREFIX_SLOTS, "an integer >= 0 (KV-cache slots)", integer=True)
    )


class ConfigError(ValueError):
    """A config.json the engine cannot run; `field` names the offending key."""

    def __init__(self, field: str, message: str, path: Path | None = None):
        # Read from a file, the error names that file: a deployment may list several checkpoints.
        if path is None:
            text = f"config.json field {field!r}: {message}"
        elif field.endswith(".json"):  # the file itself is what is wrong
            text = f"{path}: {message}"
        else:
            text = f"{path}: field {field!r}: {message}"
        super().__init__(text)
        self.field = field
        self.message = message
        self.path = path


@dataclass(frozen=True)
class Llama3RopeScaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    factor: float  # positions are divided by it


@dataclass(frozen=True)
class YarnRopeScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    attention_factor: float  # multiplies the cos/sin tables, so every q.k score by its square


# Every scaling is expressed in the model's cos/sin tables (model.rope_tables), which the fast path reads
# as they are: a new kind needs no kernel change as long as it stays a fixed table per position.
RopeScaling = Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int  # V
    hidden_size: int  # D
    num_layers: int  # N
    num_heads: int  # H
    num_kv_heads: int  # KV
    head_dim: int  # hd
    intermediate_size: int  # F
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    # The checkpoint's RoPE layout: interleaved pairs (Laneformer) or rotate-half (HF). The loader
    # permutes rotate-half q/k rows into the interleaved layout, so the model only knows one layout.
    rope_interleaved: bool = True
    num_lanes: int = 1  # L
    broadcast_delay: int = 0  # d
    use_comm: bool = True
    use_early_comm: bool = True
    lm_head_type: str = "replicate"
    pre_norm_lane_agg: bool = False
    replicated_rmsn_scale: bool = True
    sliding_window: int | None = None  # W
    window_layers: tuple[int, ...] = ()  # layers attending to the last W positions only
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3
    tie_word_embeddings: bool = False

    def __post_init__(self):
        # Lane divisibility is checked here so that configs built in code get the same errors as files.
        for name, value in (
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("num_lanes", self.num_lanes),
        ):
            if not _is_int(value) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.head_dim % 2:
            raise ConfigError("head_dim", f"must be even for RoPE, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                "num_key_value_heads",
                f"must divide num_attention_heads ({self.num_heads}), got {self.num_kv_heads}",
            )
        lanes = self.num_lanes
        for name, value in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if value % lanes:
                raise ConfigError(name, f"must be divisible by num_lanes ({lanes}), got {value}")
        if not _is_int(self.broadcast_delay) or self.broadcast_delay < 0:
            raise ConfigError("broadcast_delay", f"must be an integer >= 0, got {self.broadcast_delay!r}")
        if self.lm_head_type not in LM_HEAD_TYPES:
            raise ConfigError(
                "lm_head_type", f"must be one of {', '.join(LM_HEAD_TYPES)}; got {self.lm_head_type!r}"
            )
        if self.lm_head_type == "vocab_parallel" and self.vocab_size % lanes:
            raise ConfigError(
                "vocab_size", f"must be divisible by num_lanes ({lanes}) for a vocab_parallel head"
            )
        if self.pre_norm_lane_agg and self.lm_head_type != "replicate":
            raise ConfigError("pre_norm_lane_agg", "is only defined with lm_head_type 'replicate'")
        if self.tie_word_embeddings and self.lm_head_type != "replicate":
            raise ConfigError("tie_word_embeddings", "can only be true with lm_head_type 'replicate'")
        if self.norm_eps <= 0:
            raise ConfigError("norm_eps", f"must be > 0, got {self.norm_eps}")
        if self.rope_theta <= 0:
            raise ConfigError("rope_theta", f"must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None and (not _is_int(self.sliding_window) or self.sliding_window < 1):
            raise ConfigError(
                "sliding_window", f"must be a positive integer or null, got {self.sliding_window!r}"
            )
        if self.window_layers and self.sliding_window is None:
            raise ConfigError("sliding_window", "windowed layers are listed but no window size is set")
        if any(not 0 <= i < self.num_layers for i in self.window_layers):
            raise ConfigError(
                "sliding_window_n_layers", f"windowed layers out of range: {self.window_layers}"
            )

    @property
    def heads_per_lane(self) -> int:
        return self.num_heads // self.num_lanes

    @property
    def kv_heads_per_lane(self) -> int:
        return self.num_kv_heads // self.num_lanes

    @property
    def ffn_per_lane(self) -> int:
        return self.intermediate_size // self.num_lanes

    def window(self, layer: int) -> int | None:
        """The attention window of `layer`, or None for plain causal attention."""
        return self.sliding_window if layer in self.window_layers else None

    @classmethod
    def from_hf(cls, source: dict[str, Any] | str | Path) -> ModelConfig:
        """Read a config.json (a dict, the file, or the checkpoint directory holding it)."""
        if not isinstance(source, dict):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            check_link(path)
            if not path.is_file():
                hint = ""
                if (path.parent / "adapter_config.json").is_file():
                    hint = (
                        "; the folder holds a LoRA/PEFT adapter (adapter_config.json), not a whole model: merge "
                        "it into its base model (PEFT's merge_and_unload) and save_pretrained the result"
                    )
                raise ConfigError("config.json", f"not found{hint}", path)
            if (
                path.parent / "quantize_config.json"
            ).is_file():  # AutoGPTQ's, beside a config.json without one
                raise ConfigError(
                    "quantize_config.json",
                    "the folder holds a quantized (GPTQ) checkpoint, which is not supported; save the model "
                    "unquantized (float32, float16 or bfloat16)",
                    path.parent / "quantize_config.json",
                )
            try:
                source = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError("config.json", f"not valid JSON ({e})", path) from None
            if not isinstance(source, dict):
                raise ConfigError("config.json", "must hold a JSON object", path)
            try:
                return _parse(source)
            except ConfigError as e:
                raise ConfigError(e.field, e.message, path) from None
        return _parse(source)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_CHECKS = {
    "integer": _is_int,
    "a number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "true or false": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
}


def _parse(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError("model_type", f"is required: one of {', '.join(MODEL_TYPES)}")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            "model_type", f"unsupported {model_type!r}; expected one of {', '.join(MODEL_TYPES)}"
        )
    laneformer = model_type == "laneformer_tp"

    def get(name: str, default: Any = ..., kind: str = "integer") -> Any:
        value = raw.get(name)
        if value is None:
            if default is ...:
                raise ConfigError(name, "is required")
            return default
        if not _CHECKS[kind](value):
            raise ConfigError(name, f"must be {kind}, got {value!r}")
        return value

    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    if hidden < 1 or heads < 1:
        raise ConfigError("hidden_size" if hidden < 1 else "num_attention_heads", "must be positive")
    head_dim = None if laneformer else get("head_dim", None)
    if head_dim is None and model_type == "qwen3":
        head_dim = QWEN3_HEAD_DIM  # Qwen3's own default, not hidden / heads (64 or 80 on Qwen3-0.6B, 4B, 32B)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(
                "num_attention_heads", f"must divide hidden_size ({hidden}) when head_dim is not given"
            )
        head_dim = hidden // heads

    quantization = raw.get("quantization_config")
    if quantization:
        method = (
            quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
        )
        raise ConfigError(
            "quantization_config",
            f"quantized checkpoints ({method}) are not supported; save the model unquantized "
            "(float32, float16 or bfloat16)",
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError("hidden_act", f"only 'silu' is supported, got {act!r}")
    for name in ("attention_bias", "mlp_bias"):
        if model_type != "qwen2" and raw.get(name):
            raise ConfigError(name, "only false is supported")

    theta, scaling = _rope(raw, get)
    num_layers = get("num_hidden_layers")
    window, window_layers = _windows(raw, model_type, num_layers, get)
    return ModelConfig(
        model_type=model_type,
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=get("num_key_value_heads", heads),
        head_dim=head_dim,
        intermediate_size=get("intermediate_size"),
        max_position_embeddings=get("max_position_embeddings", 131072 if laneformer else 2048),
        norm_eps=float(
            get("norm_eps", 1e-5, "a number") if laneformer else get("rms_norm_eps", 1e-6, "a number")
        ),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleaved=laneformer,
        num_lanes=get("num_lanes", 1) if laneformer else 1,
        broadcast_delay=get("broadcast_delay", 1) if laneformer else 0,
        use_comm=get("use_comm", True, "true or false") if laneformer else True,
        use_early_comm=get("use_early_comm", True, "true or false") if laneformer else True,
        lm_head_type=get("lm_head_type", "replicate", "a string") if laneformer else "replicate",
        pre_norm_lane_agg=get("pre_norm_lane_agg", False, "true or false") if laneformer else False,
        replicated_rmsn_scale=get("replicated_rmsn_scale", True, "true or false") if laneformer else True,
        sliding_window=window,
        window_layers=window_layers,
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=get("tie_word_embeddings", False, "true or false"),
    )


def _rope(raw: dict[str, Any], get) -> tuple[float, RopeScaling | None]:
    # transformers < 5 writes rope_theta + rope_scaling; transformers >= 5 writes one rope_parameters dict.
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError("rope_parameters", "must be an object")
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise ConfigError("rope_theta", f"must be a number, got {theta!r}")
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    scaling = raw.get("rope_scaling") or params
    if not isinstance(scaling, dict):
        raise ConfigError(field, "must be an object or null")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            field, f"rope_type {rope_type!r} is not supported; expected one of {', '.join(ROPE_TYPES)}"
        )

    def number(name: str, default: Any = ...) -> float:
        value = scaling.get(name)
        if value is None and default is not ...:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(field, f"{rope_type} scaling needs a number for {name!r}, got {value!r}")
        return float(value)

    def original_max() -> int:
        # transformers fills a missing original length with max_position_embeddings.
        value = scaling.get("original_max_position_embeddings") or get("max_position_embeddings")
        if isinstance(value, float) and value.is_integer():  # 8192.0, as some tools write it
            value = int(value)
        if not _is_int(value) or value < 1:
            raise ConfigError(
                field, f"original_max_position_embeddings must be a positive integer, got {value!r}"
            )
        return value

    if rope_type == "default":
        return float(theta), None
    if rope_type == "dynamic":
        # Dynamic NTK changes the frequencies only once a sequence grows past max_position_embeddings, which the
        # engine never lets it do (its context and RoPE tables stop there): below it, it is plain RoPE.
        number("factor")
        return float(theta), None
    if rope_type == "linear":
        factor = number("factor")
        if factor <= 0:
            raise ConfigError(field, f"linear scaling needs factor > 0, got {factor}")
        return float(theta), LinearRopeScaling(factor)
    if rope_type == "yarn":
        return float(theta), _yarn(scaling, field, number, original_max, get)
    try:
        scaled = Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=original_max(),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            field, f"llama3 scaling needs factor, low_freq_factor, high_freq_factor ({e})"
        ) from None
    if scaled.low_freq_factor >= scaled.high_freq_factor or scaled.factor <= 0:
        raise ConfigError(field, "llama3 scaling needs factor > 0 and low_freq_factor < high_freq_factor")
    return float(theta), scaled


def _yarn(scaling: dict[str, Any], field: str, number, original_max, get) -> YarnRopeScaling:
    """YaRN with transformers' defaults: factor from the two lengths when null, beta_fast 32, beta_slow 1,
    a truncated correction range, and the attention factor from factor (and mscale / mscale_all_dim)."""
    factor = number("factor", None)
    original = original_max()
    if factor is None:
        factor = get("max_position_embeddings") / original
    if factor <= 0:
        raise ConfigError(field, f"yarn scaling needs factor > 0, got {factor}")

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    attention_factor = number("attention_factor", None)
    if attention_factor is None:
        m, m_all = number("mscale", 0.0), number("mscale_all_dim", 0.0)
        attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(field, f"yarn scaling's truncate must be true or false, got {truncate!r}")
    return YarnRopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=number("beta_fast", 0.0) or 32.0,  # a 0 or null means the default, as in transformers
        beta_slow=number("beta_slow", 0.0) or 1.0,
        truncate=truncate,
        attention_factor=attention_factor,
    )


def _windows(
    raw: dict[str, Any], model_type: str, num_layers: int, get
) -> tuple[int | None, tuple[int, ...]]:
    if model_type == "llama":
        return None, ()
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None, ()
    window = get("sliding_window", None)
    if window is None:
        return None, ()
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        allowed = ("full_attention", "sliding_attention")
        if (
            not isinstance(layer_types, list)
            or len(layer_types) != num_layers
            or any(t not in allowed for t in layer_types)
        ):
            raise ConfigError("layer_types", f"must list {num_layers} values out of {', '.join(allowed)}")
        return window, tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    if model_type != "laneformer_tp":
        # HF Qwen: layers from max_window_layers on are windowed (28 when the key is absent, as in transformers)
        first = get("max_window_layers", 28)
        return window, tuple(range(min(first, num_layers), num_layers))
    # Laneformer: the first n layers (the last -n when n < 0), or an explicit list; unclamped layers
    # always attend to the full causal context.
    listed = raw.get("swa_layers")
    unclamped = raw.get("unclamped_layers") or []
    for name, value in (("swa_layers", listed), ("unclamped_layers", unclamped)):
        if value is not None and (not isinstance(value, list) or not all(_is_int(i) for i in value)):
            raise ConfigError(name, "must be a list of layer indices")
    if listed is not None:
        if any(not 0 <= i < num_layers for i in listed):
            raise ConfigError("swa_layers", f"layer indices must be in 0 ... {num_layers - 1}, got {listed}")
        windowed = set(listed)
    else:
        n = get("sliding_window_n_layers", 0)
        windowed = {i for i in range(num_layers) if i < n or i >= num_layers + n}
    return window, tuple(sorted(windowed - set(unclamped)))
