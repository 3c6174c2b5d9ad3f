"""A tiny synthetic checkpoint whose tokenizer carries Qwen2.5-Coder's fill-in-the-middle tokens: the shipped
model has none yet, and the FIM tests need a model that has. fim_stack serves it beside a model without them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>")


def write_fim_checkpoint(
    out_dir: Path, preset: str = "tiny-qwen2", intermediate_size: int | None = None
) -> Path:
    """`preset` (a chatml one: random weights) with its tokenizer trained again with the FIM tokens among its
    special tokens, at the same vocabulary size, and the end ids of its config files following them.
    `intermediate_size`: a wider MLP, for a weights file of some size (a download that takes a while)."""
    from inference.synth import synth
    from inference.tokenizer_build import (
        CHAT_FORMATS,
        CHAT_TEMPLATES,
        _default_specials,
        _synthetic_corpus,
        train_bpe,
        write_tokenizer_files,
    )

    synth(preset, out_dir, seed=0)
    config = json.loads((out_dir / "config.json").read_text())
    if intermediate_size is not None:
        import torch

        from inference.checkpoint import checkpoint_shapes
        from inference.config import ModelConfig
        from inference.synth import _random_tensor, _write_weights

        config["intermediate_size"] = intermediate_size
        generator = torch.Generator().manual_seed(0)
        shapes = checkpoint_shapes(ModelConfig.from_hf(config))
        _write_weights(
            out_dir, shapes, torch.float32, lambda name, shape: _random_tensor(name, shape, generator)
        )
    style, bos, stops, extra = CHAT_FORMATS["chatml"]
    tok = train_bpe(
        _synthetic_corpus(), config["vocab_size"], style, [*_default_specials(style), *FIM_TOKENS]
    )
    write_tokenizer_files(out_dir, tok, style=style, bos=bos, eos=stops[0], chat_template=CHAT_TEMPLATES["chatml"],
                          extra_special=[*(t for t in extra if t != stops[0]), *FIM_TOKENS])  # fmt: skip
    eos = [tok.token_to_id(t) for t in stops]
    config["eos_token_id"] = eos
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = json.loads((out_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = eos
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir


@contextmanager
def fim_stack(redis_url: str, tmp: Path) -> Iterator[SimpleNamespace]:
    """A real worker serving the FIM checkpoint as `coder` and the tiny-qwen2 preset (no FIM tokens) as
    `plain`, and daphne in front of it: (web, worker, checkpoint), both stopped on the way out."""
    from tests.support import WebServer, WorkerProcess

    checkpoint = write_fim_checkpoint(tmp / "coder-ckpt")
    models = [f"coder={checkpoint}", "plain=tiny-qwen2"]
    worker = WorkerProcess(redis_url, models, tmp / "worker.log")
    web = None
    try:
        worker.wait_ready()
        web = WebServer(redis_url, tmp, env={"MODELS": ",".join(models)})
        yield SimpleNamespace(web=web, worker=worker, checkpoint=checkpoint)
    finally:
        if web is not None:
            web.stop()
        worker.stop()


def greedy_middle(engine, prefix: str, suffix: str, max_new_tokens: int, n_indent: int = 0):
    """What `engine` (the checkpoint loaded in the test's process) writes between prefix and suffix at
    temperature 0, the reference for the worker's answer: (the prompt's ids, the last event)."""
    from common.events import SamplingParams

    ids = engine.encode_fim(prefix, suffix)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, n_indent=n_indent)
    return ids, list(engine.generate(ids, params, extra_stop_ids=engine.fim.stop_ids))[-1]
