import pytest
import torch

from kernels.final_norm import final_norm
from kernels.lm_head import HeadScratch, lm_head
from tests.support.kernels import (
    DEVICE,
    assert_close,
    device_ints,
    dtype_params,
    poisoned,
    randn,
    reference_logits,
)


@pytest.mark.parametrize("dtype", dtype_params())
# (vocab, K, rows per block, blocks per program, programs per group): one group, several groups, a last group
# cut short; several row blocks a program, the last one partly past the vocabulary
@pytest.mark.parametrize(
    "vocab,k,block_n,row_blocks,group",
    [(203, 40, None, 1, 256), (64, 96, 4, 1, 4), (1000, 24, 8, 1, 16), (203, 40, 8, 3, 2), (64, 96, 4, 4, 4)],
)
def test_greedy_head_writes_logits_token_and_advances(dtype, vocab, k, block_n, row_blocks, group):
    x = randn(k, scale=2.0)
    w = randn(vocab, k, dtype=dtype, scale=k**-0.5)
    g = randn(k, dtype=dtype)
    logits = poisoned(vocab, dtype=torch.float32)
    token, pos, out_tokens = device_ints(-1), device_ints(6), device_ints(*([-1] * 10))
    scratch = HeadScratch(vocab, DEVICE)
    lm_head(x, w, logits, scratch, norm_weight=g, eps=1e-5, token=token, pos=pos, out_tokens=out_tokens,
            block_n=block_n, row_blocks=row_blocks, group=group)  # fmt: skip
    want = reference_logits(x, w, g, 1e-5)
    assert_close(logits, want, dtype, "logits")
    # the kernel's own logits decide the argmax (rounding may reorder near-ties with the fp64 reference)
    assert token.item() == int(logits.cpu().argmax())
    assert pos.item() == 7
    assert out_tokens.cpu().tolist() == [-1] * 7 + [token.item()] + [-1] * 2
    assert (scratch.counter == 0).all(), "arrival counters must return to zero for the next step"


@pytest.mark.parametrize("row_blocks", [1, 2, 3])
def test_ties_go_to_the_first_index_across_programs(row_blocks):
    """Ties in three programs of three groups (one block each), or across the blocks of one program."""
    vocab, k = 50, 16
    x = randn(k)
    w = randn(vocab, k, scale=0.01)
    best = torch.sign(x).cpu() * 3
    # rows in programs of three different groups; with row blocks, 9 and 11 also in two blocks of one program
    for row in (41, 11, 9, 23):
        w[row] = best.to(DEVICE)
    logits = poisoned(vocab, dtype=torch.float32)
    token, pos, out_tokens = device_ints(-1), device_ints(0), device_ints(-1, -1, dtype=torch.int64)
    scratch = HeadScratch(vocab, DEVICE)
    lm_head(x, w, logits, scratch, token=token, pos=pos, out_tokens=out_tokens, block_n=2, row_blocks=row_blocks,
            group=4)  # fmt: skip
    assert token.item() == 9
    assert out_tokens.cpu().tolist() == [-1, 9]


def test_rows_past_the_vocab_limit_are_never_chosen():
    vocab, k = 40, 16
    x = randn(k)
    w = randn(vocab, k, scale=0.01)
    w[35] = (torch.sign(x).cpu() * 3).to(DEVICE)  # the largest logit, in a padded row
    logits = poisoned(vocab, dtype=torch.float32)
    token, pos, out_tokens = device_ints(-1), device_ints(0), device_ints(-1, -1)
    lm_head(x, w, logits, HeadScratch(vocab, DEVICE), vocab_limit=32, token=token, pos=pos,
            out_tokens=out_tokens, block_n=4, group=2)  # fmt: skip
    assert int(logits.argmax()) == 35
    assert token.item() == int(logits[:32].argmax())


def test_sampling_mode_only_writes_logits():
    vocab, k = 77, 32
    x, w = randn(k), randn(vocab, k, scale=0.2)
    logits = poisoned(vocab, dtype=torch.float32)
    lm_head(x, w, logits, HeadScratch(vocab, DEVICE), greedy=False)
    assert_close(logits, reference_logits(x, w), torch.float32, "logits")


def host_ring(n: int) -> torch.Tensor:
    """The runner's ring of finished token ids: pinned host memory on a GPU (the interpreter runs on the CPU)."""
    return torch.full((n,), -1, dtype=torch.int32, pin_memory=DEVICE.type == "cuda")


@pytest.mark.parametrize("pos", [6, 20])  # slot (pos + 1) % 8: 7, and 5 after the ring wraps
def test_greedy_token_lands_in_the_host_ring(pos):
    vocab, k = 300, 32
    x, w = randn(k), randn(vocab, k, scale=0.2)
    token, position, out_tokens = device_ints(-1), device_ints(pos), device_ints(*([-1] * 24))
    ring = host_ring(8)
    scratch = HeadScratch(vocab, DEVICE)
    for _ in range(2):  # the same step twice: the second writes the next slot
        lm_head(x, w, torch.empty(vocab, device=DEVICE), scratch, token=token, pos=position, out_tokens=out_tokens,
                host_ring=ring, block_n=8, group=4)  # fmt: skip
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()  # the kernel's stores into host memory are visible once it has finished
    want = token.item()
    slots = [(pos + 1) % 8, (pos + 2) % 8]
    assert [ring[s].item() for s in slots] == [want, want]
    assert all(ring[s].item() == -1 for s in range(8) if s not in slots)


def test_rejects_missing_bookkeeping():
    with pytest.raises(ValueError, match="token:"):
        lm_head(randn(8), randn(4, 8), torch.empty(4, device=DEVICE), HeadScratch(4, DEVICE))
    with pytest.raises(ValueError, match="logits:"):
        lm_head(randn(8), randn(4, 8), torch.empty(5, device=DEVICE), HeadScratch(4, DEVICE), greedy=False)
    with pytest.raises(ValueError, match="row_blocks:"):
        lm_head(randn(8), randn(4, 8), torch.empty(4, device=DEVICE), HeadScratch(4, DEVICE), greedy=False,
                row_blocks=0)  # fmt: skip
    with pytest.raises(ValueError, match="host_ring:"):  # the sampled token is chosen after the head
        lm_head(randn(8), randn(4, 8), torch.empty(4, device=DEVICE), HeadScratch(4, DEVICE), greedy=False,
                host_ring=host_ring(4))  # fmt: skip
    with pytest.raises(ValueError, match="host_ring:"):
        lm_head(randn(8), randn(4, 8), torch.empty(4, device=DEVICE), HeadScratch(4, DEVICE),
                token=device_ints(0), pos=device_ints(0), out_tokens=device_ints(0, 0),
                host_ring=host_ring(4).float())  # fmt: skip


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("lanes,d", [(8, 96), (3, 50), (2, 1030)])
def test_final_norm_mean_of_normed_lanes(dtype, lanes, d):
    x = randn(lanes, d, scale=3.0)
    g = randn(lanes, d, dtype=dtype)
    out = poisoned(d, dtype=torch.float32)
    final_norm(x, g, out, eps=1e-5)
    xd = x.double().cpu()
    want = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double().cpu()).mean(0)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", dtype_params())
def test_final_norm_of_the_lane_sum(dtype):
    lanes, d = 4, 70
    x = randn(lanes, d)
    g = randn(1, d, dtype=dtype)
    out = poisoned(d, dtype=torch.float32)
    final_norm(x, g, out, eps=1e-6, norm_of_sum=True)
    s = x.double().cpu().sum(0)
    assert_close(out, s * torch.rsqrt(s.pow(2).mean() + 1e-6) * g.double().cpu()[0], dtype)
