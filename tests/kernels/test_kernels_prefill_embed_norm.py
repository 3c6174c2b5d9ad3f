# No `import triton` here: kernel_testing chooses the interpreter first.
import pytest
import torch
import torch.nn.functional as F

from inference.model import rms_norm
from kernels.prefill_embed_norm import prefill_embed_norm
from tests.support.kernels import DEVICE, dtype_params, randn


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("lanes,T,D", [(8, 13, 24), (1, 1, 16), (2, 40, 96), (3, 5, 20)])
def test_rows_and_norm_are_the_eager_reference(dtype, lanes, T, D):
    # the prefill's eager first step: embedding rows, then model.rms_norm with each lane's scale (D = 20: a row
    # that is not a multiple of the 16-byte vectors; ids repeat and skip rows)
    gen = torch.Generator().manual_seed(T)
    table = randn(50, D, dtype=dtype, scale=3.0, gen=gen)
    scale = randn(lanes, D, dtype=dtype, gen=gen) + 1.0
    ids = torch.randint(0, 50, (T,), generator=gen).to(DEVICE)
    embedded, h = prefill_embed_norm(ids, table, scale, 1e-5)
    assert torch.equal(embedded, F.embedding(ids, table))
    want = rms_norm(embedded[None], scale[:, None], 1e-5)  # [L, T, D]
    # The sum of squares in another order than PyTorch's, and 1 / sqrt for its rsqrt: fp32 results a few units
    # apart; the cast to fp16 / bf16 absorbs that nearly always (it may move one rounding by one unit).
    ulp = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    assert torch.allclose(h.float(), want.float(), rtol=4 * ulp, atol=0)
    if dtype != torch.float32:
        assert (h == want).float().mean() > 0.99


def test_int32_ids_and_an_empty_prompt():
    table, scale = randn(10, 8), randn(2, 8)
    ids = torch.tensor([3, 0, 9], dtype=torch.int32, device=DEVICE)
    embedded, h = prefill_embed_norm(ids, table, scale, 1e-6)
    assert torch.equal(embedded, table[ids.long()]) and h.shape == (2, 3, 8)
    embedded, h = prefill_embed_norm(ids[:0], table, scale, 1e-6)
    assert embedded.shape == (0, 8) and h.shape == (2, 0, 8)


def test_bad_arguments_are_named():
    table, scale, ids = randn(10, 8), randn(2, 8), torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="table:"):
        prefill_embed_norm(ids, table.t(), scale, 1e-6)
    with pytest.raises(ValueError, match="ids:"):
        prefill_embed_norm(ids.float(), table, scale, 1e-6)
    with pytest.raises(ValueError, match="ids:"):
        prefill_embed_norm(ids[None], table, scale, 1e-6)
    with pytest.raises(ValueError, match="scale:"):
        prefill_embed_norm(ids, table, randn(2, 6), 1e-6)
    with pytest.raises(ValueError, match="scale:"):
        prefill_embed_norm(ids, table, scale.half(), 1e-6)
