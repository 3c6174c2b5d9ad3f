"""The counters that order a decode step's kernels (kernels/step_sync.py): each launch waits on the one before
and its programs each signal once."""

import pytest
import torch
from kernel_testing import DEVICE, randn

from kernels.lane_reduce_gemv import lane_reduce_gemv
from kernels.rmsnorm_gemv import rmsnorm_gemv
from kernels.step_sync import StepChain


def test_links_wait_on_the_previous_launch_and_its_program_count():
    chain = StepChain(4, DEVICE)
    first, second, third = chain.link(7), chain.link(3), chain.link(0)
    assert (first.wait_target, first.signal_index) == (0, 0)  # the step's first kernel waits on nothing
    assert (second.wait_index, second.wait_target, second.signal_index) == (0, 7, 1)
    assert (third.wait_index, third.wait_target) == (1, 3)
    assert chain.used == 3 and chain.reset_block() == 4
    chain.start()
    assert chain.link(5).signal_index == 0
    with pytest.raises(ValueError, match="chain"):
        for _ in range(5):
            chain.link(1)


def test_every_program_signals_once_and_results_do_not_change():
    gen = torch.Generator().manual_seed(0)
    lanes, n, k = 2, 48, 64
    x = randn(lanes, k, gen=gen)
    w, w_up = randn(lanes, n, k, gen=gen, scale=0.1), randn(lanes, n, k, gen=gen, scale=0.1)
    w_down = randn(lanes, k, n, gen=gen, scale=0.1)
    plain_h = rmsnorm_gemv(x, w, torch.empty(lanes, n, device=DEVICE), weight_up=w_up)
    plain_x = lane_reduce_gemv(plain_h, w_down, x.clone())

    chain = StepChain(2, DEVICE)
    h = rmsnorm_gemv(x, w, torch.empty(lanes, n, device=DEVICE), weight_up=w_up, chain=chain, prefetch_kb=64,
                     block_n=16, block_k=32)  # fmt: skip
    x_out = lane_reduce_gemv(h, w_down, x.clone(), chain=chain, prefetch_kb=64, block_n=16, block_k=32)
    # grids: (48 / 16 row blocks) x 2 lanes, then 64 / 16 row blocks
    assert chain.flags.tolist() == [3 * lanes, k // 16]
    torch.testing.assert_close(h, plain_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_out, plain_x, rtol=1e-5, atol=1e-6)
