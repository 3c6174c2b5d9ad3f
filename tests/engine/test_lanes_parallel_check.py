"""python -m inference.bench.lanes_check, the GPU machine's check of the lanes on several processes, run here on
the CPU against a tiny preset: one JSON line, every decisive step agreeing, exit 0."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.support import ROOT


def lanes_check(*flags: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "inference.bench.lanes_check", "--model", "tiny-laneformer",
                           "--procs", "2", "--prompt-len", "20", "--new-tokens", "6", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "dtype"), [("gloo", "float32"), ("peer", "bfloat16")])
def test_the_lanes_check_agrees_on_every_decisive_step(mode, dtype):
    result = lanes_check("--mode", mode, "--dtype", dtype)
    assert (result["mode"], result["dtype"], result["steps"]) == (mode, dtype, 6)
    assert result["decisive_steps"] > 0 and result["decisive_same"] == result["decisive_steps"]


@pytest.mark.slow
def test_the_engine_check_compares_the_workers_lane_engine():
    result = lanes_check("--mode", "gloo", "--engine")
    assert result["identical"] and result["steps"] == 6


def test_the_scaling_table_runs_on_gpus_and_refuses_without_one():
    done = subprocess.run([sys.executable, "-m", "inference.bench.lanes_scaling", "--model", "tiny-laneformer",
                           "--procs", "1", "2", "--dtype", "float32", "--init", "peaked", "--prompt-len", "16", "--new-tokens", "12"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    if not torch.cuda.is_available():
        assert done.returncode == 2 and done.stderr == "lanes_scaling: needs a CUDA GPU\n", done.stderr
        return
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["1", "1", "2"]  # the one-GPU runner's row, then 1 and 2 ranks
    assert all(row[-1] == "12/12" for row in rows)  # fp32, peaked weights: the one-GPU runner's tokens
