import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference import synth
from inference.checkpoint import CheckpointError, checkpoint_shapes, load_weights
from inference.config import ModelConfig
from inference.model import Transformer
from tests.support import ROOT

# <linux/capability.h>, <linux/prctl.h>
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, PR_CAPBSET_DROP = 1, 2, 24


@pytest.fixture(scope="module")
def tiny_laneformer(tmp_path_factory):
    return synth.synth("tiny-laneformer", tmp_path_factory.mktemp("tiny-laneformer"), seed=0)


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_loads_into_the_model_layout_without_copies(tiny_laneformer):
    cfg = ModelConfig.from_hf(tiny_laneformer)
    weights = load_weights(tiny_laneformer, cfg)
    expected = Transformer(cfg, device="meta").state_dict()
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in expected.items()}
    L, D = cfg.num_lanes, cfg.hidden_size
    assert weights["layers.0.wq"].shape == (L, cfg.heads_per_lane * cfg.head_dim, D)
    assert weights["layers.0.attention_norm"].shape == (L, D)
    model = Transformer.from_weights(cfg, weights)
    assert model.layers[0].wq.data_ptr() == weights["layers.0.wq"].data_ptr()
    assert not any(p.requires_grad for p in model.parameters())  # an inference model


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, tiny_laneformer, monkeypatch):
    monkeypatch.setattr(synth, "SHARD_BYTES", 300_000)
    sharded = synth.synth("tiny-laneformer", tmp_path / "sharded", seed=0)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (sharded / "model.safetensors").exists()
    cfg = ModelConfig.from_hf(sharded)
    single, split = load_weights(tiny_laneformer, cfg), load_weights(sharded, cfg)
    assert single.keys() == split.keys()
    assert all(torch.equal(single[k], split[k]) for k in single)


def test_target_dtype(tiny_laneformer):
    cfg = ModelConfig.from_hf(tiny_laneformer)
    weights = load_weights(tiny_laneformer, cfg, dtype=torch.bfloat16)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}


def test_one_error_lists_missing_unexpected_and_misshaped(tmp_path, tiny_laneformer):
    ckpt = copy_checkpoint(tiny_laneformer, tmp_path / "bad")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.attention.wk.weight"]
    tensors["model.layers.0.attention.extra.weight"] = torch.zeros(3)
    tensors["model.layers.2.feed_forward.w2.weight"] = torch.zeros(4, 64, 40)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_weights(ckpt, ModelConfig.from_hf(ckpt))
    message = str(info.value)
    assert "\n" not in message
    assert "missing 1: model.layers.1.attention.wk.weight" in message
    assert "unexpected 1: model.layers.0.attention.extra.weight" in message
    assert (
        "wrong shape 1: model.layers.2.feed_forward.w2.weight [4, 64, 40] (expected [4, 64, 48])" in message
    )


def test_wrong_config_for_the_weights(tmp_path, tiny_laneformer):
    ckpt = copy_checkpoint(tiny_laneformer, tmp_path / "other")
    raw = json.loads((ckpt / "config.json").read_text())
    raw["num_lanes"] = 2
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError, match=r"wrong shape \d+: model.layers.0.attention.wq.weight \[4, 16, 64\]"
    ):
        load_weights(ckpt, ModelConfig.from_hf(ckpt))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_file_is_one_line_error(tmp_path, tiny_laneformer, damage):
    ckpt = copy_checkpoint(tiny_laneformer, tmp_path / "damaged")
    data = (ckpt / "model.safetensors").read_bytes()
    damaged = {"truncate": data[: len(data) // 2], "garbage": b"\x07not safetensors" * 50, "empty": b""}[
        damage
    ]
    (ckpt / "model.safetensors").write_bytes(damaged)
    with pytest.raises(CheckpointError, match="corrupt or truncated safetensors") as info:
        load_weights(ckpt, ModelConfig.from_hf(ckpt))
    assert "\n" not in str(info.value) and "model.safetensors" in str(info.value)


def test_pickle_checkpoints_are_refused(tmp_path, tiny_laneformer):
    torch.save({"model.tok_embeddings.weight": torch.zeros(2, 2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*arbitrary code.*safetensors") as info:
        load_weights(tmp_path, ModelConfig.from_hf(tiny_laneformer))
    assert "\n" not in str(info.value)


def test_missing_directory_weights_and_shards(tmp_path, tiny_laneformer):
    cfg = ModelConfig.from_hf(tiny_laneformer)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_weights(tmp_path / "nowhere", cfg)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_weights(tmp_path, cfg)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard files that are not there: model-00002-of-00002"):
        load_weights(tmp_path, cfg)
    (tmp_path / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        load_weights(tmp_path, cfg)


def test_tied_checkpoint_may_still_carry_its_head(tmp_path):
    ckpt = synth.synth("tiny-qwen2", tmp_path / "q", seed=0)
    cfg = ModelConfig.from_hf(ckpt)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in checkpoint_shapes(cfg)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, ckpt / "model.safetensors")
    weights = load_weights(ckpt, cfg)
    assert "lm_head" not in weights  # the model reads the embedding as its head


def test_laneformer_names_follow_the_published_modules():
    base = {
        "model_type": "laneformer_tp",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    base |= {"intermediate_size": 64, "vocab_size": 40, "num_lanes": 2}
    lane = checkpoint_shapes(
        ModelConfig.from_hf({**base, "lm_head_type": "lane", "replicated_rmsn_scale": False})
    )
    assert lane["lm_head.linear.weight"] == (40, 64)
    assert lane["model.layers.0.attention_norm.scale"] == (2, 32) and lane["model.norm.scale"] == (2, 32)
    vocab = checkpoint_shapes(ModelConfig.from_hf({**base, "lm_head_type": "vocab_parallel"}))
    assert vocab["lm_head.weight"] == (2, 20, 32) and vocab["model.norm.weight"] == (32,)
    agg = checkpoint_shapes(
        ModelConfig.from_hf({**base, "pre_norm_lane_agg": True, "replicated_rmsn_scale": False})
    )
    assert agg["model.norm.weight"] == (32,) and agg["model.layers.0.ffn_norm.scale"] == (2, 32)


def test_a_tokenizer_or_end_token_past_the_vocabulary_is_refused_at_load(tmp_path, tiny_laneformer):
    from inference.engine import Engine

    vocab = json.loads((tiny_laneformer / "config.json").read_text())["vocab_size"]
    grown = copy_checkpoint(tiny_laneformer, tmp_path / "grown")
    tokenizer = json.loads((grown / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append(
        {
            "id": vocab + 10,
            "content": "<|extra|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }  # fmt: skip
    )
    (grown / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(CheckpointError, match=rf"has token id \d+, past the model's vocab_size {vocab}"):
        Engine.load(grown, device="cpu")

    endless = copy_checkpoint(tiny_laneformer, tmp_path / "endless")
    (endless / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab + 3}))
    with pytest.raises(
        CheckpointError, match=rf"eos_token_id \[{vocab + 3}\] is past the model's vocab_size"
    ):
        Engine.load(endless, device="cpu")
    assert Engine.load(tiny_laneformer, device="cpu").tokenizer.max_id < vocab  # the good one loads


def test_a_token_past_a_gap_in_the_ids_can_be_written(tmp_path, tiny_laneformer):
    # A tokenizer whose ids leave a gap below its last ones: the model must still be able to write those (were
    # one of them the end token, the model could never stop).
    from inference.engine import Engine

    vocab = json.loads((tiny_laneformer / "config.json").read_text())["vocab_size"]
    gapped = copy_checkpoint(tiny_laneformer, tmp_path / "gapped")
    tokenizer = json.loads((gapped / "tokenizer.json").read_text())
    bpe = tokenizer["model"]
    # the three merges before the last made ids vocab - 4 .. vocab - 2, and nothing later builds on them
    for pair in bpe["merges"][-4:-1]:
        del bpe["vocab"]["".join(pair)]
    del bpe["merges"][-4:-1]
    (gapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    engine = Engine.load(gapped, device="cpu")
    assert engine.tokenizer.max_id == vocab - 1 and engine.tokenizer.vocab_size == vocab - 3
    assert engine.runner.vocab_limit == vocab  # the last id can be written


def without_root_reading_everything() -> None:
    """In a child about to exec: root without the capabilities that let it read a file whatever its mode."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_weights_file_this_process_may_not_read_is_said_so(tmp_path, tiny_laneformer):
    # save_pretrained writes its shards with mode 0600: a worker of another user must hear why it cannot load them.
    model = copy_checkpoint(tiny_laneformer, tmp_path / "model")
    weights = sorted(model.glob("*.safetensors"))[0]
    weights.chmod(0o000)
    load = (
        "from inference.checkpoint import CheckpointError, load_weights\n"
        "from inference.config import ModelConfig\n"
        f"try: load_weights({str(model)!r}, ModelConfig.from_hf({str(model)!r}))\n"
        "except CheckpointError as e: print(e)\n"
    )
    as_root = os.geteuid() == 0
    result = subprocess.run([sys.executable, "-c", load], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            preexec_fn=without_root_reading_everything if as_root else None)  # fmt: skip
    assert result.stdout.strip() == (
        f"{weights}: not readable by this process (permission denied); let its user read it, e.g. chmod a+r"
    ), result.stderr


def hf_checkpoint(tmp_path, preset="tiny-llama"):
    """A synthetic HF-named checkpoint (embed_tokens, self_attn, ...) and its weights as loaded."""
    ckpt = synth.synth(preset, tmp_path / preset, seed=0)
    cfg = ModelConfig.from_hf(ckpt)
    return ckpt, cfg, load_weights(ckpt, cfg)


def test_rotary_inv_freq_buffers_of_older_transformers_are_ignored(tmp_path):
    ckpt, cfg, expected = hf_checkpoint(tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    for i in range(cfg.num_layers):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(cfg.head_dim // 2)
    save_file(tensors, ckpt / "model.safetensors")
    weights = load_weights(ckpt, cfg)
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)


def test_a_base_model_saved_without_the_model_prefix_loads(tmp_path):
    # What saving model.model (LlamaModel, Qwen2Model) writes: no `model.` prefix, and no head (tied here).
    ckpt, cfg, expected = hf_checkpoint(tmp_path, "tiny-qwen2")
    assert cfg.tie_word_embeddings
    tensors = load_file(ckpt / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, ckpt / "model.safetensors")
    weights = load_weights(ckpt, cfg)
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)


def test_a_tied_config_with_a_different_saved_head_is_refused(tmp_path):
    ckpt, cfg, _ = hf_checkpoint(tmp_path)
    assert cfg.tie_word_embeddings
    tensors = load_file(ckpt / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_weights(ckpt, cfg)
    message = str(info.value)
    assert message.startswith(str(ckpt / "model.safetensors")) and "\n" not in message
    assert (
        "lm_head.weight differs from model.embed_tokens.weight" in message
        and "'tie_word_embeddings'" in message
    )


def test_a_lora_adapter_is_not_read_as_a_shard(tmp_path):
    ckpt, cfg, expected = hf_checkpoint(tmp_path)
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)},
              ckpt / "adapter_model.safetensors")  # fmt: skip
    weights = load_weights(ckpt, cfg)  # the adapter left beside the merged model is no part of it
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    (ckpt / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match="only a LoRA/PEFT adapter .*merge_and_unload"):
        load_weights(ckpt, cfg)


def test_tied_weights_saved_under_the_head_name_only(tmp_path):
    # Some exporters keep the head's name of a tied pair; transformers ties the embedding to it.
    ckpt, cfg, expected = hf_checkpoint(tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, ckpt / "model.safetensors")
    weights = load_weights(ckpt, cfg)
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)


def test_model_safetensors_wins_over_an_index_as_in_transformers(tmp_path, monkeypatch):
    # A re-save without sharding writes model.safetensors and leaves the old index (and maybe its shards):
    # transformers loads the single file, and so do we, whether or not the shards are still there.
    single, cfg, expected = hf_checkpoint(tmp_path)
    monkeypatch.setattr(synth, "SHARD_BYTES", 100_000)
    sharded = synth.synth("tiny-llama", tmp_path / "sharded", seed=1)  # other weights
    assert not (sharded / "model.safetensors").exists() and len(list(sharded.glob("model-*.safetensors"))) > 1
    shutil.copy(single / "model.safetensors", sharded / "model.safetensors")

    def same(weights):
        return weights.keys() == expected.keys() and all(
            torch.equal(weights[k], expected[k]) for k in weights
        )

    assert same(load_weights(sharded, cfg))  # index, its shards and the single file: the single file
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32)
    assert torch.equal(theirs.model.embed_tokens.weight.detach(), expected["tok_embeddings"])
    for shard in sharded.glob("model-*.safetensors"):  # a stale index whose shards are gone
        shard.unlink()
    assert same(load_weights(sharded, cfg))


def hf_snapshot(tmp_path, source, with_files=()):
    """`source` as an HF cache holds it, models--acme--tiny/snapshots/<hash>/: each file a link to
    ../../blobs/<hash>; only the blobs of `with_files` there (none: a snapshot mounted without its blobs/)."""
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    if with_files:
        (repo / "blobs").mkdir()
    for file in sorted(source.iterdir()):
        blob = hashlib.sha256(file.name.encode()).hexdigest()
        if file.name in with_files:
            shutil.copy(file, repo / "blobs" / blob)
        (snapshot / file.name).symlink_to(f"../../blobs/{blob}")
    return snapshot


def test_a_snapshot_without_its_blobs_says_which_file_is_a_broken_link(tmp_path):
    from inference.engine import Engine
    from inference.tokenizer import Tokenizer

    source, cfg, _ = hf_checkpoint(tmp_path)

    def broken(snapshot, name):
        link = snapshot / name
        return (
            f"{link} is a broken symbolic link (to ../../blobs/{hashlib.sha256(name.encode()).hexdigest()})"
        )

    bare = hf_snapshot(tmp_path / "bare", source)
    for load, name in ((ModelConfig.from_hf, "config.json"), (Tokenizer.from_dir, "tokenizer.json")):
        with pytest.raises(CheckpointError) as info:
            load(bare)
        message = str(info.value)
        assert message.startswith(broken(bare, name)) and "blobs/ folder" in message and "\n" not in message
    with pytest.raises(CheckpointError) as info:
        load_weights(bare, cfg)
    assert str(info.value).startswith(broken(bare, "model.safetensors"))
    # a file that is read only when there (tokenizer_config.json) is no less broken: not silently skipped
    no_tokenizer_config = hf_snapshot(tmp_path / "half", source, {"config.json", "tokenizer.json"})
    with pytest.raises(CheckpointError) as info:
        Tokenizer.from_dir(no_tokenizer_config)
    assert str(info.value).startswith(broken(no_tokenizer_config, "tokenizer_config.json"))
    # the cache's blobs/ is there without this one: downloaded in part, not mounted in part
    assert "its blob is missing from the cache: download the model again" in str(info.value)
    # all but the weights: the engine says so of the weights
    no_weights = hf_snapshot(tmp_path / "weights", source, {p.name for p in source.glob("*.json")})
    with pytest.raises(CheckpointError) as info:
        Engine.load(no_weights, device="cpu")
    assert str(info.value).startswith(broken(no_weights, "model.safetensors"))
    # the whole cache: it loads, under the repo's id
    whole = hf_snapshot(tmp_path / "whole", source, {p.name for p in source.iterdir()})
    assert Engine.load(whole, device="cpu").name == "acme/tiny"
