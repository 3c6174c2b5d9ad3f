"""python -m inference.bench.lanes_check, the GPU machine's check of the lanes on several processes, run here on
the CPU against a tiny preset: one JSON line, every decisive step agreeing, exit 0."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


@pytest.mark.slow
def test_the_scaling_table_has_a_row_for_each_process_count():
    done = subprocess.run([sys.executable, "-m", "inference.bench.lanes_scaling", "--model", "tiny-laneformer",
                           "--procs", "1", "2", "--mode", "gloo", "--dtype", "float32", "--prompt-len", "16",
                           "--new-tokens", "6", "--breakdown"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["procs"] for row in rows] == [1, 2]
    assert all(row["tok_s"] > 0 and 0 < row["exchange_share"] < 1 for row in rows)
