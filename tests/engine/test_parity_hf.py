"""Parity with Hugging Face transformers (a test dependency only): tiny random Llama / Qwen2 / Qwen3
models built and saved by transformers load in our engine and decode the same greedy tokens with the
same logits; and for every family, prefill-then-decode equals full recomputation."""

import json
from dataclasses import replace

import pytest
import torch

from common.events import SamplingParams, TextDelta
from inference import synth
from inference.checkpoint import load_weights
from inference.config import ModelConfig
from inference.engine import Engine
from inference.model import KVCache, Transformer
from inference.tokenizer_build import write_synthetic_tokenizer

transformers = pytest.importorskip("transformers")

STEPS, PROMPT_LEN = 64, 8
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Awkward shapes: head_dim set apart from hidden/heads (48), one KV head, odd vocabularies.
CASES = {
    "llama-hd48-llama3-untied": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=48, vocab_size=1001,
             rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, tie_word_embeddings=False),
    ),
    "llama-1kv-tied": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, vocab_size=512, tie_word_embeddings=True),
    ),
    "qwen2-1kv-odd-vocab-tied": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, vocab_size=999, tie_word_embeddings=True),
    ),
    "qwen2-untied": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False),
    ),
    "qwen3-hd48-untied": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=48, vocab_size=1001,
             tie_word_embeddings=False),
    ),
    # head_dim left out of config.json, as hand-written configs do: Qwen3's default is 128, not hidden / heads
    "qwen3-no-head-dim-tied": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True),
    ),
    "qwen3-1kv-tied": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=777,
             tie_word_embeddings=True),
    ),
    # Qwen's sliding window on the layers from max_window_layers on (16 positions; the decode runs to 72).
    "qwen2-window-tied": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
             use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ),
    # RoPE scalings of long-context fine-tunes; the decode runs past YaRN's original length (32).
    "llama-linear-tied": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
             rope_scaling={"rope_type": "linear", "factor": 4.0}),
    ),
    "llama-dynamic-untied": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False,
             rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    ),
    "qwen2-yarn-tied": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, vocab_size=999, tie_word_embeddings=True,
             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    ),
    "qwen3-yarn-mscale-untied": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=777,
             tie_word_embeddings=False, rope_theta=10000.0,
             rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                           "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16}),
    ),
}  # fmt: skip


def build_hf_model(case: str, path, **save_options):
    model_cls, config_cls, options = CASES[case]
    config = getattr(transformers, config_cls)(
        num_hidden_layers=2, intermediate_size=160, max_position_embeddings=256, rms_norm_eps=1e-5, **options
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # larger than HF's init so that every part moves the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, **save_options)
    if "head_dim" not in options:  # config.json without it (transformers writes its default)
        config_file = path / "config.json"
        config_file.write_text(
            json.dumps({k: v for k, v in json.loads(config_file.read_text()).items() if k != "head_dim"})
        )
    return model


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max()).item()


def hf_greedy(model, prompt: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    tokens, logits = [], []
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        logits.append(out.logits[0])
        for _ in range(STEPS):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(
                input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
            )
            logits.append(out.logits[0])
    return tokens, logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_decode_matches_transformers(tmp_path, case):
    hf_model = build_hf_model(case, tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)
    assert (
        cfg.model_type == hf_model.config.model_type
        and cfg.tie_word_embeddings == CASES[case][2]["tie_word_embeddings"]
    )
    model = Transformer.from_weights(cfg, load_weights(tmp_path, cfg))
    prompt = torch.randint(0, cfg.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    hf_tokens, hf_logits = hf_greedy(hf_model, prompt)
    assert len(set(hf_tokens)) > 4, "a degenerate model would make this test weak"

    cache = KVCache(cfg, max_len=PROMPT_LEN + STEPS + 1)
    tokens = []
    with torch.inference_mode():
        logits = model(prompt, 0, cache)[0]
        for step in range(STEPS + 1):
            assert relative_error(logits, hf_logits[step]) < 1e-4, f"step {step}"
            if step == STEPS:
                break
            tokens.append(int(logits[-1].argmax()))
            logits = model(torch.tensor([[tokens[-1]]]), PROMPT_LEN + step, cache)[0]
    assert tokens == hf_tokens

    # The whole engine on the same directory (plus tokenizer files): the same greedy tokens, up to EOS.
    special = write_synthetic_tokenizer(tmp_path, "chatml", cfg.vocab_size)
    engine = Engine.load(tmp_path, device="cpu")
    assert engine.tokenizer.vocab_size == cfg.vocab_size  # no padded ids are masked out of the argmax
    events = engine.generate(prompt[0].tolist(), SamplingParams(max_new_tokens=STEPS))
    engine_tokens = [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]
    assert engine_tokens == hf_tokens[: len(engine_tokens)]
    assert len(engine_tokens) == STEPS or engine_tokens[-1] in engine.tokenizer.eos_ids | set(
        special["eos_token_id"]
    )


@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_decode_equals_full_recomputation(tmp_path, preset, dtype):
    path = synth.synth(preset, tmp_path / preset, seed=0)
    cfg = ModelConfig.from_hf(path)
    model = Transformer.from_weights(cfg, load_weights(path, cfg, dtype=dtype))
    ids = torch.randint(0, cfg.vocab_size, (1, 80), generator=torch.Generator().manual_seed(2))
    cache = KVCache(cfg, max_len=80, dtype=dtype)
    with torch.inference_mode():
        steps = [model(ids[:, :30], 0, cache)]
        steps += [model(ids[:, t : t + 1], t, cache) for t in range(30, 80)]
        stepwise = torch.cat(steps, dim=1)[0]
        full = model(ids)[0]
        last = model(ids, last_only=True)[0, -1]
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for t in range(80):
        assert relative_error(stepwise[t], full[t]) < tolerance, f"position {t}"
    torch.testing.assert_close(last, full[-1])


@pytest.mark.parametrize("case", ["llama-linear-tied", "qwen2-yarn-tied", "qwen3-yarn-mscale-untied"])
def test_rope_scaling_cases_do_change_the_logits(tmp_path, case):
    # Keeps the cases above meaningful: run as plain RoPE, the same weights are far from transformers' logits.
    hf_model = build_hf_model(case, tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg.rope_scaling is not None
    plain = replace(cfg, rope_scaling=None)
    model = Transformer.from_weights(plain, load_weights(tmp_path, plain))
    ids = torch.randint(0, cfg.vocab_size, (1, 72), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative_error(model(ids)[0], hf_model(input_ids=ids).logits[0]) > 1e-2


def test_own_finetune_saved_by_transformers_serves_like_transformers(tmp_path):
    """A whole fine-tuned folder as transformers writes it: model.save_pretrained (sharded) and
    tokenizer.save_pretrained (chat_template.jinja, an added token), with Llama 3's stop tokens in
    generation_config.json. The chat prompt's ids and the greedy tokens are transformers' own."""
    from tokenizers import AddedToken

    model_dir, tok_dir = tmp_path / "finetune", tmp_path / "base-tokenizer"
    hf_model = build_hf_model("llama-hd48-llama3-untied", model_dir, max_shard_size="100KB")
    assert (model_dir / "model.safetensors.index.json").is_file()

    special = write_synthetic_tokenizer(tok_dir, "llama3", hf_model.config.vocab_size - 8)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    hf_tok.add_tokens([AddedToken("<think>", special=False), AddedToken("<|tool|>", special=True)])
    hf_tok.save_pretrained(model_dir)
    assert (model_dir / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((model_dir / "tokenizer_config.json").read_text())
    generation = {"bos_token_id": special["bos_token_id"], "eos_token_id": special["eos_token_id"]}
    (model_dir / "generation_config.json").write_text(json.dumps(generation))

    engine = Engine.load(model_dir, device="cpu")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo <think> 😀"}]
    ids = engine.encode_prompt(messages=messages)
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids == list(theirs["input_ids"]) and ids[0] == special["bos_token_id"]
    assert engine.tokenizer.eos_ids == set(special["eos_token_id"])

    hf_tokens, _ = hf_greedy(hf_model, torch.tensor([ids]))
    events = engine.generate(ids, SamplingParams(max_new_tokens=STEPS))
    engine_tokens = [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]
    assert engine_tokens == hf_tokens[: len(engine_tokens)] and len(engine_tokens) > 8
