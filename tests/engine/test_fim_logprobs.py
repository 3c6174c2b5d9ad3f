"""Fill-in-the-middle prompts for each family of FIM tokens (tokenizers built here with them), and logprobs from
the fast path's engine on a GPU checked against a forward pass of the same weights."""

from __future__ import annotations

import pytest
import torch

from common.events import SamplingParams
from inference.fim import find_fim_tokens
from inference.tokenizer import Tokenizer
from inference.tokenizer_build import _default_specials, _synthetic_corpus, train_bpe, write_tokenizer_files

FAMILIES = [
    ("bytelevel", ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>"], None),
    ("bytelevel", ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"], None),
    ("sentencepiece", ["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"], "▁<EOT>"),
    ("bytelevel", ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], None),
]


def tokenizer_with(tmp_path, style: str, fim: list[str]) -> Tokenizer:
    specials = [*_default_specials(style), *fim]
    tok = train_bpe(_synthetic_corpus(), 1024, style, specials)
    bos, eos = ("<s>", "</s>") if style == "sentencepiece" else (None, "<|endoftext|>")
    unk = "<unk>" if style == "sentencepiece" else None
    write_tokenizer_files(
        tmp_path, tok, style=style, bos=bos, eos=eos, unk=unk, chat_template=None, extra_special=fim
    )
    return Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("style, spelled, ender", FAMILIES)
def test_each_family_of_fim_tokens_makes_prefix_suffix_middle(tmp_path, style, spelled, ender):
    tokenizer = tokenizer_with(tmp_path, style, spelled)
    fim = find_fim_tokens(tokenizer)
    assert fim is not None and list(fim.spelling) == spelled[:3]
    assert fim.stop_ids == ({tokenizer._tok.token_to_id(ender)} if ender else fim.stop_ids)
    # (SentencePiece reads a typed "▁" as its space marker: the spelling without it)
    prefix, suffix = f"def f(x):  # {spelled[2].lstrip('▁')} is text here\n    return ", "\n\nprint(f(1))\n"
    ids = fim.prompt_ids(tokenizer, prefix, suffix)
    start = [tokenizer.bos_id] if tokenizer.add_bos else []
    assert ids[: len(start) + 1] == [*start, fim.prefix] and ids[-1] == fim.middle
    cut = ids.index(fim.suffix)
    # the code is text: the middle token's spelling inside it is characters, the only FIM tokens are the three
    assert [ids.count(i) for i in (fim.prefix, fim.suffix, fim.middle)] == [1, 1, 1]
    assert tokenizer.decode(ids[len(start) + 1 : cut]).strip() == prefix.strip()
    assert tokenizer.decode(ids[cut + 1 : -1]) == suffix


def test_a_tokenizer_without_fim_tokens_has_none(tmp_path):
    assert find_fim_tokens(tokenizer_with(tmp_path, "bytelevel", [])) is None


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_on_the_fast_path_engine_match_a_forward_pass(temperature):
    """On a GPU the engine runs the fast path; a request with logprobs goes through a reference runner on the
    same weights, reading the whole head (no screen): its values match one forward pass over the tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from inference.engine import Engine
    from inference.fast import FastRunner

    engine = Engine.load("tiny-qwen3", device="cuda", dtype="bfloat16")
    assert isinstance(engine.runner, FastRunner)
    prompt_ids = engine.tokenizer.encode_text("def merge(a, b):\n")
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=3, logprobs=5)
    deltas = [e for e in engine.generate(prompt_ids, params) if e.kind == "delta" and e.logprobs]
    entries = [entry for delta in deltas for entry in delta.logprobs]
    new_ids = [entry["id"] for entry in entries]
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt_ids + new_ids], device="cuda"))
    reference = logits[0, len(prompt_ids) - 1 : -1, : engine.tokenizer.max_id + 1].float().log_softmax(-1)
    for i, entry in enumerate(entries):
        # bf16 weights: a prefill of the whole sequence and the decode steps round differently
        assert entry["logprob"] == pytest.approx(float(reference[i, entry["id"]]), abs=5e-2)
        if temperature == 0:
            assert entry["top"][0]["id"] == entry["id"]
    # a request without logprobs still runs on the fast path
    assert engine.logprob_runner() is not engine.runner
