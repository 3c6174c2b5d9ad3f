"""kernels/peer_post.py and kernels/peer_wait.py in one process: a post copies the values into the right row of
every mailbox and raises the right flag to the epoch; a wait returns once every flag of its slot holds the epoch
and, when one never comes, gives up and says so in its status. (The cross-process use is
tests/engine/test_lanes_peer.py.)"""

import pytest
import torch

from kernels.peer_post import peer_post
from kernels.peer_wait import peer_wait
from tests.support.kernels import DEVICE

P, SLOTS, ROWS, D = 3, 4, 5, 40


def mailboxes(dtype):
    rows = [torch.zeros(SLOTS, P, ROWS, D, dtype=dtype, device=DEVICE) for _ in range(P)]
    flags = [torch.zeros(SLOTS, P, dtype=torch.int32, device=DEVICE) for _ in range(P)]
    tables = [
        torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE) for ts in (rows, flags)
    ]
    return rows, flags, *tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_rank_posting_a_slot_fills_every_mailbox_and_the_waits_return(dtype):
    rows, flags, row_table, flag_table = mailboxes(dtype)
    epoch = torch.tensor([7], dtype=torch.int32, device=DEVICE)
    slot, T = 2, 3  # 3 of a slot's 5 rows: a piece shorter than the mailbox
    posted = [torch.randn(T, D, dtype=dtype, device=DEVICE) for _ in range(P)]
    for rank, values in enumerate(posted):
        peer_post(values, row_table, flag_table, (slot * P + rank) * ROWS * D, slot * P + rank, epoch)
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for owner in range(P):
        peer_wait(flags[owner][slot], epoch, status)
        assert flags[owner][slot].tolist() == [7] * P
        for rank in range(P):
            torch.testing.assert_close(rows[owner][slot, rank, :T], posted[rank], rtol=0, atol=0)
        assert not rows[owner][slot, :, T:].any() and not rows[owner][[0, 1, 3]].any()  # nothing else written
        assert not flags[owner][[0, 1, 3]].any()
    assert status.item() == 0


def test_a_wait_for_a_flag_that_never_comes_gives_up_and_says_so():
    rows, flags, row_table, flag_table = mailboxes(torch.float32)
    epoch = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    for rank in (0, 2):  # rank 1 never posts
        peer_post(torch.ones(D, device=DEVICE), row_table, flag_table, rank * ROWS * D, rank, epoch)
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    peer_wait(flags[0][0], epoch, status, max_spins=50)
    assert status.item() == 1
    epoch += 1  # last step's flags are not this step's
    status.zero_()
    peer_wait(flags[0][0], epoch, status, max_spins=50)
    assert status.item() == 1


def test_once_a_wait_gave_up_the_next_ones_do_not_spin():
    rows, flags, row_table, flag_table = mailboxes(torch.float32)
    epoch = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    status = torch.ones(1, dtype=torch.int32, device=DEVICE)  # an earlier wait of the step gave up
    # a bound no test could sit out (~2^30 rounds): the wait returns at once, the status still set
    peer_wait(flags[0][0], epoch, status, max_spins=1 << 30)
    assert status.item() == 1


@pytest.mark.parametrize(
    "folded_residual", [True, False]
)  # 2 lanes a rank: the sum over K with x in it; 8: not
def test_a_partial_posted_by_its_own_launch_fills_every_mailbox_and_the_last_program_raises_the_flags(
    folded_residual,
):
    from kernels.lane_reduce_gemv import lane_reduce_gemv

    lanes, total, n, k, slots = (2, 4, 48, 64, 3) if folded_residual else (8, 16, 48, 64, 3)
    rank, world = 1, total // lanes
    # every rank's mailbox: rows [slots, ranks, its lanes' partials] and flags [slots, ranks]
    history = [torch.zeros(slots, world, lanes * n, device=DEVICE) for _ in range(world)]
    flags = [torch.zeros(slots, world, dtype=torch.int32, device=DEVICE) for _ in range(world)]
    row_table = torch.tensor([h.data_ptr() for h in history], dtype=torch.int64, device=DEVICE)
    flag_table = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=DEVICE)
    epoch = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)  # the slot's programs done
    act, weight = torch.randn(lanes, k, device=DEVICE), torch.randn(lanes, n, k, device=DEVICE)
    x = torch.randn(lanes, n, device=DEVICE)
    past = torch.randn(total, n, device=DEVICE)
    slot = 2
    own = history[rank][slot].view(total, n)  # this rank's mailbox holds the slot's rows of every lane
    post = (row_table, flag_table, slot * world * lanes * n, slot * world + rank, epoch, count)
    lane_reduce_gemv(act, weight, x, mode="delayed", history_out=own, history_in=past, lane_start=rank * lanes,
                     total_lanes=total, block_n=8, post=post)  # fmt: skip
    partial = torch.einsum("lnk,lk->ln", weight, act)
    for owner in range(world):
        rows = history[owner][slot].view(total, n)
        torch.testing.assert_close(rows[rank * lanes : (rank + 1) * lanes], partial, rtol=1e-4, atol=1e-4)
        assert not rows[: rank * lanes].any() and not rows[(rank + 1) * lanes :].any()
        assert not history[owner][[0, 1]].any()
        assert flags[owner].tolist() == [
            [0] * world,
            [0] * world,
            [5 if r == rank else 0 for r in range(world)],
        ]
    assert count.item() == 0  # the last program left the slot's count for the next step
