"""kernels/accept_draft.py against the rule written out in Python: the drafts kept, the tokens emitted, and the decode
state (token, pos, out_tokens, seen) plain steps emitting them would leave; rows past a draft's (a graph's
bucket) ignored, and nothing written past the emitted tokens."""

import random

import pytest
import torch

from kernels.accept_draft import accept_draft
from tests.support.kernels import DEVICE, ON_GPU

VOCAB, CONTEXT = 50, 64


def expected(chosen: list[int], draft: list[int]) -> list[int]:
    """The emitted tokens: the model's token at each row while the draft agrees, then its first other one."""
    emitted = []
    for j, token in enumerate(chosen[: len(draft) + 1]):
        emitted.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return emitted


def run(chosen: list[int], draft: list[int], start: int, seen_before: set[int]):
    rows = len(chosen)
    staged = torch.tensor([start, len(draft), -7, *draft, *[-9] * (rows - 1 - len(draft))], device=DEVICE)
    token = torch.tensor([-1], dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([start], dtype=torch.int32, device=DEVICE)
    out_tokens = torch.full((CONTEXT + 1,), -5, dtype=torch.int32, device=DEVICE)
    seen = torch.zeros(VOCAB, dtype=torch.bool, device=DEVICE)
    seen[list(seen_before)] = True
    host = torch.full((rows + 1,), -3, dtype=torch.int32, pin_memory=ON_GPU)
    accept_draft(torch.tensor(chosen, device=DEVICE), staged, token=token, pos=pos, out_tokens=out_tokens,
                 seen=seen, host=host)  # fmt: skip
    if ON_GPU:
        torch.cuda.synchronize()
    return token, pos, out_tokens, seen, host


@pytest.mark.parametrize(
    "chosen,draft",
    [
        ([4, 5, 6, 7], [4, 5, 6]),  # every draft kept: k + 1 tokens
        ([9, 5, 6, 7], [4, 5, 6]),  # the first rejected: the model's own token alone
        ([4, 5, 8, 7], [4, 5, 6]),  # two kept, then the model's
        ([4, 4, 4, 4, 2, 3, 1, 0], [4, 4, 4]),  # a bucket of 8 rows for 4: rows past k + 1 ignored
        ([4, 5], [4]),
        ([3, 3], [4]),
    ],
)
def test_the_kept_drafts_and_the_models_token_are_emitted_and_the_state_moves_past_them(chosen, draft):
    start = 20
    token, pos, out_tokens, seen, host = run(chosen, draft, start, seen_before={1, 2})
    emitted = expected(chosen, draft)
    n = len(emitted) - 1
    assert host.tolist()[: n + 2] == [n, *emitted]
    assert host.tolist()[n + 2 :] == [-3] * (len(chosen) - n - 1)  # nothing past the emitted tokens
    assert token.tolist() == [emitted[-1]] and pos.tolist() == [start + n + 1]
    out = out_tokens.tolist()
    assert out[start + 1 : start + 2 + n] == emitted
    assert out[: start + 1] == [-5] * (start + 1) and out[start + 2 + n :] == [-5] * (CONTEXT - start - 1 - n)
    assert set(seen.nonzero().flatten().tolist()) == {1, 2, *emitted}


def test_random_drafts_match_the_rule():
    rng = random.Random(0)
    for _ in range(40):
        rows = rng.choice([2, 4, 8, 16, 32])
        k = rng.randrange(1, rows)
        draft = [rng.randrange(VOCAB) for _ in range(k)]
        kept = rng.randrange(k + 1)  # the model agrees with the first `kept` drafts, maybe by chance beyond
        chosen = draft[:kept] + [rng.randrange(VOCAB) for _ in range(rows - kept)]
        start = rng.randrange(0, CONTEXT - rows)
        token, pos, out_tokens, seen, host = run(chosen, draft, start, seen_before=set())
        emitted = expected(chosen, draft)
        assert host.tolist()[: len(emitted) + 1] == [len(emitted) - 1, *emitted]
        assert token.tolist() == [emitted[-1]] and pos.tolist() == [start + len(emitted)]
        assert out_tokens[start + 1 : start + 1 + len(emitted)].tolist() == emitted
        assert set(seen.nonzero().flatten().tolist()) == set(emitted)


def test_bad_buffers_are_refused_with_their_name():
    chosen = torch.tensor([1, 2], device=DEVICE)
    state = dict(token=torch.zeros(1, dtype=torch.int32, device=DEVICE),
                 pos=torch.zeros(1, dtype=torch.int32, device=DEVICE),
                 out_tokens=torch.zeros(8, dtype=torch.int32, device=DEVICE),
                 seen=torch.zeros(8, dtype=torch.bool, device=DEVICE))  # fmt: skip
    staged = torch.tensor([0, 1, 0, 1], device=DEVICE)
    host = torch.zeros(3, dtype=torch.int32, pin_memory=ON_GPU)
    with pytest.raises(ValueError, match="chosen"):
        accept_draft(chosen.int(), staged, host=host, **state)
    with pytest.raises(ValueError, match="staged"):
        accept_draft(chosen, staged[:3], host=host, **state)
    with pytest.raises(ValueError, match="host"):
        accept_draft(chosen, staged, host=host[:2], **state)
    with pytest.raises(ValueError, match="seen"):
        accept_draft(chosen, staged, host=host, **{**state, "seen": state["seen"].int()})
