"""A Laneformer's lanes divided among processes (inference/lanes_parallel.py), joined by gloo on the CPU: the
same greedy tokens as the one-process reference model in fp32, for several lane counts, delays, windows and
process counts; and Llama/Qwen models run the same way as lanes summed at every block (tensor parallelism)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from inference.checkpoint import checkpoint_tensors
from inference.config import ModelConfig
from inference.lanes_parallel import (
    LaneShard,
    greedy_job,
    load_lane_slices,
    parallel_config,
    parallel_model,
    spawn_lanes,
)
from inference.model import KVCache
from inference.presets import PRESETS
from inference.synth import peaked_model
from tests.support import ROOT

PROMPT = [5, 17, 300, 42, 9, 77, 128, 3, 250, 64, 11, 199]
NEW_TOKENS = 12


def tiny(lanes: int, delay: int, window: int | None, **extra) -> dict:
    return {
        "model_type": "laneformer_tp",
        "hidden_size": 64,
        "num_hidden_layers": 5,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "intermediate_size": 128,
        "vocab_size": 509,  # not divisible by the process counts: the head's uneven shares
        "num_lanes": lanes,
        "broadcast_delay": delay,
        "use_comm": True,
        "use_early_comm": True,
        "lm_head_type": "replicate",
        "sliding_window": window,
        "sliding_window_n_layers": 3 if window else 0,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        **extra,
    }


def reference(raw: dict, seed: int) -> tuple[list[int], torch.Tensor]:
    """The one-process model's greedy tokens and the logits of the step after the last (fp32)."""
    model = peaked_model(ModelConfig.from_hf(raw), seed)
    cache = KVCache(model.cfg, len(PROMPT) + NEW_TOKENS)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT]), 0, cache, last_only=True)[0, -1]
        tokens = [int(logits.argmax())]
        while len(tokens) <= NEW_TOKENS:
            logits = model(torch.tensor([tokens[-1:]]), len(PROMPT) + len(tokens) - 1, cache)[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[:NEW_TOKENS], logits


@pytest.mark.slow
@pytest.mark.parametrize(
    ("lanes", "delay", "window", "world", "extra"),
    [
        (2, 1, 4, 2, {}),
        (4, 2, None, 2, {}),
        (4, 1, 4, 4, {"use_early_comm": False}),
        (8, 2, 4, 8, {}),
        (8, 1, None, 4, {"pre_norm_lane_agg": True}),
    ],
)
def test_lanes_on_several_processes_decode_the_one_process_models_tokens(lanes, delay, window, world, extra):
    raw = tiny(lanes, delay, window, **extra)
    expected, expected_logits = reference(raw, seed=lanes + delay)
    results = spawn_lanes(
        world, functools.partial(greedy_job, raw, lanes + delay, PROMPT, NEW_TOKENS, "gloo")
    )
    for tokens, logits in results:  # every rank holds the same answer
        assert tokens == expected
        torch.testing.assert_close(torch.tensor(logits), expected_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_a_llama_or_qwen_on_two_processes_decodes_the_one_process_models_tokens(preset):
    raw = PRESETS[preset]["config"]
    expected, expected_logits = reference(raw, seed=5)
    results = spawn_lanes(2, functools.partial(greedy_job, raw, 5, PROMPT, NEW_TOKENS, "gloo"))
    for tokens, logits in results:
        assert tokens == expected
        torch.testing.assert_close(torch.tensor(logits), expected_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_a_llama_or_qwen_as_lanes_summed_at_every_block_is_the_one_lane_model(preset):
    cfg = ModelConfig.from_hf(PRESETS[preset]["config"])
    model = peaked_model(cfg, seed=2)
    world = cfg.num_kv_heads  # as many shares as the KV heads allow
    lanes = parallel_model(model, world)
    assert (lanes.cfg.num_lanes, lanes.cfg.broadcast_delay) == (world, 0)
    assert lanes.layers[0].wq.shape[0] == world
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = model(ids, 0, KVCache(cfg, len(PROMPT)))
        got = lanes(ids, 0, KVCache(lanes.cfg, len(PROMPT)))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    back = parallel_model(lanes, 1)  # and back to one lane, every weight where it was
    pairs = zip(back.state_dict().values(), model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_llama_or_qwen_whose_heads_do_not_divide_among_the_processes_is_refused():
    cfg = ModelConfig.from_hf(PRESETS["tiny-qwen2"]["config"])  # one KV head
    with pytest.raises(ValueError, match="2 processes cannot share the 1 key/value heads of this qwen2"):
        parallel_config(cfg, 2)


def sized_job(size: int, failing_rank: int, rank: int, world: int) -> list[float]:
    """A result of `size` floats from every rank but `failing_rank`, which ends with exit code 3 while the
    others wait for it in a collective."""
    if rank == failing_rank:
        raise SystemExit(3)
    torch.distributed.barrier()
    return [float(rank)] * size


def test_results_larger_than_a_pipe_come_back_and_a_failed_rank_ends_the_run():
    results = spawn_lanes(2, functools.partial(sized_job, 200_000, -1))  # ~1.8 MB pickled a rank
    assert [len(r) for r in results] == [200_000, 200_000] and results[1][0] == 1.0
    with pytest.raises(RuntimeError, match="lane processes failed with exit codes"):
        spawn_lanes(2, functools.partial(sized_job, 10, 1))  # rank 0 waits for it in the barrier


# A fresh interpreter: what the ranks' processes are. The threads are counted around the process group's life.
RANK_TEARDOWN = """
import os
import torch.distributed as dist
from inference.config import ModelConfig
from inference.lanes_parallel import LaneShard, free_port, greedy, init_rank, parallel_model
from inference.presets import PRESETS
from inference.synth import peaked_model

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
init_rank(0, 1, free_port(), "gloo")
during = threads()
model = parallel_model(peaked_model(ModelConfig.from_hf(PRESETS["tiny-qwen3"]["config"]), 5), 2)
greedy(LaneShard(model, 0, 1, 16), [5, 17, 300], 4)
dist.destroy_process_group()
print(before, during, threads())
"""


def test_a_rank_ends_its_process_groups_threads_when_it_destroys_the_group():
    # A gloo thread that outlives destroy_process_group can finish a collective during the interpreter's exit,
    # need the GIL there and abort the rank after it has sent its result.
    done = subprocess.run([sys.executable, "-c", RANK_TEARDOWN], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    before, during, after = map(int, done.stdout.split())
    assert during > before  # the group's threads, so that their end is seen
    assert after == before


def test_lanes_that_do_not_divide_among_the_processes_are_refused():
    model = peaked_model(ModelConfig.from_hf(tiny(4, 1, None)), 0)
    with pytest.raises(ValueError, match="3 processes cannot share 4 lanes"):
        LaneShard(model, 0, 3, 16)


@pytest.mark.parametrize("replicated_norms", [True, False])
@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_reads_only_its_lanes_and_holds_the_shard_the_whole_model_gives(
    tmp_path, world, replicated_norms
):
    raw = tiny(4, 1, 4, replicated_rmsn_scale=replicated_norms)
    cfg = ModelConfig.from_hf(raw)
    model = peaked_model(cfg, seed=3)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(
        {n: t.contiguous() for n, t in checkpoint_tensors(model).items()}, tmp_path / "model.safetensors"
    )
    for rank in range(world):
        part = load_lane_slices(tmp_path, cfg, rank, world, torch.device("cpu"), torch.float32)
        assert part.cfg.num_lanes == 4 // world and part.layers[0].wq.shape[0] == 4 // world
        whole, sliced = LaneShard(model, rank, world, 16), LaneShard(part, rank, world, 16, cfg=cfg)
        assert sliced.lanes == whole.lanes
        for a, b in zip(whole.blocks, sliced.blocks, strict=True):
            pairs = zip(a.named_parameters(), b.named_parameters(), strict=True)
            assert all(n == m and torch.equal(x, y) for (n, x), (m, y) in pairs)
        assert torch.equal(part.norm[sliced.own], model.norm[whole.own])
        assert torch.equal(part.tok_embeddings, model.tok_embeddings) and torch.equal(
            part.lm_head, model.lm_head
        )


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_a_llama_or_qwen_rank_reads_only_its_share_of_the_checkpoint(tmp_path, preset):
    raw = {
        **PRESETS[preset]["config"],
        "num_key_value_heads": 2,
        "tie_word_embeddings": preset == "tiny-llama",
    }
    cfg = ModelConfig.from_hf(raw)
    model = peaked_model(cfg, seed=4)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(
        {n: t.contiguous() for n, t in checkpoint_tensors(model).items()}, tmp_path / "model.safetensors"
    )
    lanes_cfg = parallel_config(cfg, 2)
    for rank in range(2):
        part = load_lane_slices(tmp_path, lanes_cfg, rank, 2, torch.device("cpu"), torch.float32)
        assert (
            part.cfg.num_heads == cfg.num_heads // 2
            and part.cfg.intermediate_size == cfg.intermediate_size // 2
        )
        whole = LaneShard(parallel_model(model, 2), rank, 2, 16)
        sliced = LaneShard(part, rank, 2, 16, cfg=lanes_cfg)
        for a, b in zip(whole.blocks, sliced.blocks, strict=True):
            pairs = zip(a.named_parameters(), b.named_parameters(), strict=True)
            assert all(n == m and torch.equal(x, y) for (n, x), (m, y) in pairs)
        assert torch.equal(whole.head_rows, sliced.head_rows)


def test_lane_slices_of_a_model_whose_head_is_split_by_lane_are_refused(tmp_path):
    cfg = ModelConfig.from_hf(tiny(4, 1, None, lm_head_type="vocab_parallel", vocab_size=512))
    with pytest.raises(ValueError, match="replicated head only"):
        load_lane_slices(tmp_path, cfg, 0, 2, torch.device("cpu"), torch.float32)
