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
