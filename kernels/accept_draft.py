"""The end of a greedy speculative verify step, on the device: which drafts the model kept, and the decode state
plain steps would have left after the tokens it emits.

For a step from position p over the current token and k drafts d_0 .. d_{k-1}, chosen [R] holds the model's
argmax after each of its R >= k + 1 rows (rows past k + 1 belong to a graph's bucket and are ignored):

    n = the first j < k with chosen[j] != d_j, else k        (the drafts kept)
    emitted = chosen[0 .. n]                                 (the kept drafts, then the model's own token)
    out_tokens[p + 1 + j] = chosen[j] and seen[chosen[j]] = True for j <= n;  token = chosen[n];  pos = p + n + 1
    host = [n, chosen[0 .. n]]                               (pinned host memory on a GPU)

In the verify graph this replaces a copy of every row's token to the host, the comparison there and the state's
copies back: the host waits once, on the graph, and reads what it yields from `host`.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_draft_kernel(chosen_ptr, staged_ptr, token_ptr, pos_ptr, out_tokens_ptr, seen_ptr, host_ptr,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    j = tl.arange(0, BLOCK)
    start = tl.load(staged_ptr)  # staged: [p, k, the current token's slot, d_0 .. d_{k-1}]
    k = tl.load(staged_ptr + 1)
    chosen = tl.load(chosen_ptr + j, mask=j < ROWS, other=-1)
    draft = tl.load(staged_ptr + 3 + j, mask=j < k, other=-1)
    kept = (chosen == draft) & (j < k)
    n = tl.min(tl.where(kept, BLOCK, j), axis=0)  # the first row not kept: n <= k < ROWS
    emitted = j <= n
    tl.store(out_tokens_ptr + start + 1 + j, chosen.to(out_tokens_ptr.dtype.element_ty), mask=emitted)
    tl.store(seen_ptr + chosen, tl.full([BLOCK], 1, seen_ptr.dtype.element_ty), mask=emitted)
    last = tl.sum(tl.where(j == n, chosen, 0), axis=0)
    tl.store(token_ptr, last.to(token_ptr.dtype.element_ty))
    tl.store(pos_ptr, (start + n + 1).to(pos_ptr.dtype.element_ty))
    tl.store(host_ptr, n.to(host_ptr.dtype.element_ty))
    tl.store(host_ptr + 1 + j, chosen.to(host_ptr.dtype.element_ty), mask=emitted)


def accept_draft(chosen: torch.Tensor, staged: torch.Tensor, *, token: torch.Tensor, pos: torch.Tensor,
                 out_tokens: torch.Tensor, seen: torch.Tensor, host: torch.Tensor) -> None:  # fmt: skip
    """chosen [R] int64: the argmax of each verify row; staged int64 [p, k, (slot), d_0 .. d_{k-1}] with k < R;
    token and pos int32 [1], out_tokens int32 [context + 1] and seen bool [V]: the runner's decode state, updated
    as the module docstring says; host int32 [R + 1] (pinned on a GPU) receives [n, chosen[0 .. n]]."""
    rows = chosen.numel()
    if chosen.dim() != 1 or chosen.dtype != torch.int64:
        raise ValueError(f"chosen: expected a 1-D int64 tensor, got {chosen.dtype} {tuple(chosen.shape)}")
    if staged.dtype != torch.int64 or staged.numel() < rows + 2:
        raise ValueError(f"staged: expected int64 [>= {rows + 2}], got {staged.dtype} {tuple(staged.shape)}")
    if host.dtype != torch.int32 or host.numel() < rows + 1:
        raise ValueError(f"host: expected int32 [>= {rows + 1}], got {host.dtype} {tuple(host.shape)}")
    if seen.dtype != torch.bool:
        raise ValueError(f"seen: expected bool, got {seen.dtype}")
    _accept_draft_kernel[(1,)](chosen, staged, token, pos, out_tokens, seen, host, ROWS=rows,
                               BLOCK=triton.next_power_of_2(rows))  # fmt: skip
