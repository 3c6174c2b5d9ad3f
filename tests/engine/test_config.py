import json
import math

import pytest

from inference.checkpoint import checkpoint_shapes
from inference.config import ConfigError, ModelConfig
from inference.presets import PRESETS, preset_config


def laneformer(**overrides) -> dict:
    raw = {
        "model_type": "laneformer_tp",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 100,
        "num_lanes": 4,
    }
    raw.update(overrides)
    return raw


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_parses(name):
    cfg = ModelConfig.from_hf(preset_config(name))
    assert cfg.model_type == PRESETS[name]["config"]["model_type"]


def test_laneformer_2b_preset_matches_laneformer_md():
    cfg = ModelConfig.from_hf(preset_config("laneformer-2b"))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (3072, 15, 32, 16)
    assert (cfg.num_lanes, cfg.broadcast_delay, cfg.head_dim, cfg.vocab_size) == (8, 2, 96, 32000)
    assert cfg.window_layers == tuple(range(10)) and cfg.sliding_window == 2048
    assert cfg.rope_interleaved and not cfg.tie_word_embeddings
    # docs/laneformer.md: the preset's D = 3072, F = 12288 give 2,320,069,632 parameters (the published 2.3B)
    assert sum(math.prod(s) for s in checkpoint_shapes(cfg).values()) == 2_320_069_632


def test_hf_presets_carry_their_family_options():
    llama = ModelConfig.from_hf(preset_config("llama-3.2-1b"))
    assert llama.rope_scaling.factor == 32 and llama.tie_word_embeddings and not llama.rope_interleaved
    assert llama.num_lanes == 1 and llama.head_dim == 64
    qwen2 = ModelConfig.from_hf(preset_config("qwen2.5-coder-1.5b"))
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.window_layers == ()  # use_sliding_window false
    qwen3 = ModelConfig.from_hf(preset_config("qwen3-1.7b"))
    assert qwen3.qk_norm and qwen3.head_dim == 128 and qwen3.hidden_size // qwen3.num_heads == 128


def test_reads_a_checkpoint_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(laneformer()))
    assert ModelConfig.from_hf(tmp_path).num_lanes == 4
    assert ModelConfig.from_hf(tmp_path / "config.json").num_lanes == 4


def test_missing_and_invalid_config_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"model_type": "gpt2"}, "model_type", "laneformer_tp, llama, qwen2, qwen3"),
        ({"model_type": None}, "model_type", "is required: one of"),
        ({"model_type": "mamba"}, "model_type", "unsupported 'mamba'"),
        (
            {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2},
            "num_attention_heads",
            "divisible by num_lanes",
        ),
        ({"num_key_value_heads": 2}, "num_key_value_heads", "divisible by num_lanes (4)"),
        ({"num_key_value_heads": 3, "num_lanes": 1}, "num_key_value_heads", "must divide"),
        ({"intermediate_size": 130}, "intermediate_size", "divisible by num_lanes"),
        ({"hidden_size": None}, "hidden_size", "required"),
        ({"hidden_size": "64"}, "hidden_size", "integer"),
        ({"hidden_size": 60}, "num_attention_heads", "must divide hidden_size"),
        ({"lm_head_type": "tied"}, "lm_head_type", "replicate, lane, vocab_parallel"),
        ({"lm_head_type": "vocab_parallel", "vocab_size": 101}, "vocab_size", "divisible"),
        ({"lm_head_type": "lane", "pre_norm_lane_agg": True}, "pre_norm_lane_agg", "replicate"),
        ({"lm_head_type": "lane", "tie_word_embeddings": True}, "tie_word_embeddings", "replicate"),
        ({"use_comm": "yes"}, "use_comm", "true or false"),
        ({"broadcast_delay": -1}, "broadcast_delay", ">= 0"),
        ({"sliding_window": 0, "sliding_window_n_layers": 2}, "sliding_window", "positive"),
        ({"swa_layers": [0, 9], "sliding_window": 8}, "swa_layers", "0 ... 5"),
        ({"swa_layers": "all", "sliding_window": 8}, "swa_layers", "list"),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 4}},
            "rope_scaling",
            "default, linear, dynamic, yarn, llama3",
        ),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling", "'factor'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": "4"}}, "rope_parameters", "'factor'"),
        ({"rope_scaling": {"rope_type": "llama3"}}, "rope_scaling", "factor"),
    ],
)
def test_bad_fields_are_named(overrides, field, words):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf(laneformer(**overrides))
    assert info.value.field == field
    assert words in str(info.value) and field in str(info.value)
    assert "\n" not in str(info.value)


def test_hf_only_options_are_refused_for_other_families():
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    base["vocab_size"] = 100
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelConfig.from_hf({**base, "model_type": "llama", "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelConfig.from_hf({**base, "model_type": "llama", "attention_bias": True})
    assert ModelConfig.from_hf({**base, "model_type": "qwen2"}).qkv_bias


def test_laneformer_window_layers():
    n_first = ModelConfig.from_hf(laneformer(sliding_window=8, sliding_window_n_layers=2))
    assert n_first.window_layers == (0, 1) and n_first.window(0) == 8 and n_first.window(2) is None
    n_last = ModelConfig.from_hf(laneformer(sliding_window=8, sliding_window_n_layers=-2))
    assert n_last.window_layers == (4, 5)
    listed = ModelConfig.from_hf(laneformer(sliding_window=8, swa_layers=[1, 3, 5], unclamped_layers=[3]))
    assert listed.window_layers == (1, 5)
    no_size = ModelConfig.from_hf(laneformer(sliding_window=None, sliding_window_n_layers=3))
    assert no_size.window_layers == () and no_size.window(0) is None
    defaults = ModelConfig.from_hf(laneformer())
    assert defaults.broadcast_delay == 1 and defaults.use_comm and defaults.lm_head_type == "replicate"


def test_qwen_sliding_window_follows_hf_rules():
    raw = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}
    raw |= {"intermediate_size": 128, "vocab_size": 100, "sliding_window": 16, "max_window_layers": 1}
    assert ModelConfig.from_hf(raw).window_layers == ()  # use_sliding_window defaults to false
    assert ModelConfig.from_hf({**raw, "use_sliding_window": True}).window_layers == (1, 2, 3)
    types = ["sliding_attention", "full_attention"] * 2
    on = ModelConfig.from_hf({**raw, "use_sliding_window": True, "layer_types": types})
    assert on.window_layers == (0, 2)


def test_rope_parameters_of_transformers_5_read_like_rope_scaling():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 64
    raw = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    raw |= {"intermediate_size": 128, "vocab_size": 100}
    old = ModelConfig.from_hf({**raw, "rope_theta": 5e5, "rope_scaling": scaling})
    new = ModelConfig.from_hf({**raw, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling.original_max_position_embeddings == 64
    default = ModelConfig.from_hf({**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert default.rope_scaling is None and default.rope_theta == 1e6


def llama(**overrides) -> dict:
    raw = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    return raw | {"intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 256} | overrides


def test_rope_scaling_kinds_of_hf_checkpoints():
    from inference.config import LinearRopeScaling, YarnRopeScaling

    linear = ModelConfig.from_hf(llama(rope_scaling={"type": "linear", "factor": 2.0}))
    assert linear.rope_scaling == LinearRopeScaling(2.0)
    # Dynamic NTK only departs from plain RoPE past max_position_embeddings, where the engine never goes.
    dynamic = ModelConfig.from_hf(llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert dynamic.rope_scaling is None
    # Qwen2.5's documented long-context setting, written the transformers 4 way ("type").
    yarn = ModelConfig.from_hf(
        llama(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    )
    assert isinstance(yarn.rope_scaling, YarnRopeScaling)
    assert (yarn.rope_scaling.factor, yarn.rope_scaling.original_max_position_embeddings) == (4.0, 64)
    assert (yarn.rope_scaling.beta_fast, yarn.rope_scaling.beta_slow, yarn.rope_scaling.truncate) == (
        32,
        1,
        True,
    )
    assert yarn.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    null = ModelConfig.from_hf(llama(rope_scaling=None, rope_theta=123.0))
    assert null.rope_scaling is None and null.rope_theta == 123.0


def test_errors_of_a_config_file_name_the_file(tmp_path):
    for model_type in ("mistral", "gemma"):
        (tmp_path / "config.json").write_text(json.dumps(llama(model_type=model_type)))
        with pytest.raises(ConfigError) as info:
            ModelConfig.from_hf(tmp_path)
        message = str(info.value)
        assert message.startswith(
            f"{tmp_path / 'config.json'}: field 'model_type': unsupported '{model_type}'"
        )
        assert "laneformer_tp, llama, qwen2, qwen3" in message and info.value.field == "model_type"
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'nowhere'}: not found$"):
        ModelConfig.from_hf(tmp_path / "nowhere")


def test_lora_adapters_and_quantized_checkpoints_are_refused_by_name(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(ConfigError, match="LoRA/PEFT adapter .*merge_and_unload"):
        ModelConfig.from_hf(tmp_path)
    quantized = llama(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(
        ConfigError, match="quantized checkpoints \\(bitsandbytes\\) are not supported"
    ) as info:
        ModelConfig.from_hf(quantized)
    assert info.value.field == "quantization_config"


def test_qwen_max_window_layers_defaults_as_in_transformers():
    raw = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 30, "num_attention_heads": 4}
    raw |= {"intermediate_size": 128, "vocab_size": 100, "sliding_window": 16, "use_sliding_window": True}
    assert ModelConfig.from_hf(raw).window_layers == (28, 29)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.Qwen2Config(**{k: v for k, v in raw.items() if k != "model_type"}).layer_types
    assert tuple(i for i, t in enumerate(theirs) if t == "sliding_attention") == (28, 29)
