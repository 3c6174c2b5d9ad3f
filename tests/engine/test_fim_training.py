"""inference/fim_training.py: fill-in-the-middle training examples."""

import random

from tokenizers import Tokenizer

from inference.fim_training import (
    EOS,
    FIM_MIDDLE,
    FIM_PREFIX,
    FIM_SUFFIX,
    SPECIAL_TOKENS,
    cut_points,
    document_segments,
    encode_segments,
    fim_segments,
    pieces,
    psm_prompt,
)
from inference.tokenizer_build import train_bpe

SOURCE = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(40))


def test_pieces_are_line_aligned_and_join_back():
    parts = pieces(SOURCE, 100)
    assert "".join(parts) == SOURCE
    assert all(len(p) <= 100 and p.endswith("\n") for p in parts)
    assert pieces("x" * 250 + "\nshort\n", 100) == ["x" * 250 + "\n", "short\n"]  # a long line stays whole


def test_cut_points_are_ordered_and_in_range():
    rng = random.Random(0)
    for _ in range(200):
        a, b = cut_points(SOURCE[:300], rng)
        assert 0 <= a <= b <= 300


def test_psm_and_spm_layouts_hold_the_whole_piece():
    rng = random.Random(1)
    seen = set()
    for _ in range(50):
        segs = fim_segments(SOURCE[:200], rng)
        names = [s for s, special in segs if special]
        texts = [s for s, special in segs if not special]
        assert segs[0] == (FIM_PREFIX, True) and segs[-1] == (EOS, True)
        assert names == [FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, EOS]
        spm = segs[1] == (FIM_SUFFIX, True)  # SPM: the prefix follows the middle marker, then the middle
        prefix, suffix, middle = (texts[1], texts[0], texts[2]) if spm else texts
        seen.add(spm)
        assert prefix + middle + suffix == SOURCE[:200]
    assert seen == {True, False}  # both orders occur


def test_document_segments_rate_and_determinism():
    plain = list(document_segments("a.py", SOURCE, 0.0, 0, 120))
    assert "".join(s for s, special in plain if not special) == SOURCE and plain[-1] == (EOS, True)
    assert sum(special for _, special in plain) == 1
    mixed = list(document_segments("a.py", SOURCE, 0.5, 0, 120))
    assert mixed == list(document_segments("a.py", SOURCE, 0.5, 0, 120))  # same key and seed, same examples
    examples = sum(s == FIM_PREFIX for s, _ in mixed)
    assert 0.25 < examples / len(pieces(SOURCE, 120)) < 0.75
    assert mixed != list(document_segments("a.py", SOURCE, 0.5, 1, 120))


def test_encoding_keeps_special_names_in_text_as_text():
    tok = train_bpe([SOURCE] * 3, 400, "bytelevel", SPECIAL_TOKENS)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    tok.encode_special_tokens = True
    written = 'MARK = "<|fim_prefix|>"\n'  # a source file that mentions the marker
    ids = encode_segments(tok, [(written, False), (EOS, True)])
    assert ids.tolist()[-1] == 0 and 1 not in ids.tolist()
    assert tok.decode(ids.tolist()[:-1]) == written
    segs = [
        (FIM_PREFIX, True),
        ("a = 1\n", False),
        (FIM_SUFFIX, True),
        ("c = 3\n", False),
        (FIM_MIDDLE, True),
    ]
    tok.encode_special_tokens = False
    assert encode_segments(tok, segs).tolist() == tok.encode(psm_prompt("a = 1\n", "c = 3\n")).ids
    assert isinstance(Tokenizer.from_str(tok.to_str()), Tokenizer)
