"""inference/train_default.py end to end on a CPU, tiny: corpus -> tokenizer -> FIM streams -> training ->
sharded checkpoint -> packed -> installed (scripts/install_default.py) -> the engine loads and runs it."""

import json
import stat
import sys

import torch

from common.events import SamplingParams
from inference.engine import Engine
from inference.fim_training import SPECIAL_TOKENS, psm_prompt
from inference.train import split_of
from inference.train_default import function_documents, main
from tests.support import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from install_default import install  # noqa: E402


def module(i: int) -> str:
    return "".join(
        f'def func_{i}_{j}(value, other={j}):\n    """Combine value with {j}."""\n'
        f"    total = value * {j} + other\n    return total - {i}\n\n\n"
        for j in range(30)
    )


def small_library(root):
    """Python files whose path hashes put some in every split."""
    root.mkdir()
    needed = {"train": 4, "validation": 1, "test": 1}
    i = 0
    while any(needed.values()):
        name = f"mod{i}.py"
        if needed[split_of(name)]:
            needed[split_of(name)] -= 1
            (root / name).write_text(module(i))
        i += 1
    return root


def test_builds_packs_and_installs_a_loadable_fim_model(tmp_path):
    lib = small_library(tmp_path / "lib")
    out, packed, model_dir = tmp_path / "out", tmp_path / "packed", tmp_path / "default"
    args = ["--out", str(out), "--pack", str(packed), "--stdlib", str(lib), "--no-packages", "--size", "tiny",
            "--steps", "4", "--check-steps", "2", "--seq-len", "32", "--batch-size", "2", "--vocab-size", "320",
            "--tokenizer-sample-mb", "1", "--device", "cpu"]  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # a tiny model: more threads only wait on each other (tens of times slower on a busy CPU)
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)

    summary = json.loads((out / "training.json").read_text())
    assert summary["steps"] == 4 and summary["repeat_check"]["identical"] is True
    assert summary["corpus"]["splits"] == {"test": 1, "train": 4, "validation": 1}
    # every function of the 4 training modules, twice, beside the files themselves
    functions = summary["function_documents"]
    assert functions["found"] == functions["self_contained"] == 4 * 30 and functions["copies"] == 2
    assert 0 < functions["tokens"] < summary["training_tokens"]
    assert (
        summary["repeat_final_run"].startswith("python -m inference.train_default")
        and "--steps 4" in summary["repeat_final_run"]
    )
    shards = sorted(p.name for p in packed.glob("model-*.safetensors"))
    assert shards and {p.name for p in packed.iterdir()} == {*shards, "default-rest.tar"}

    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(
        b"old weights"
    )  # an old single file must not stay beside shards
    installed = install(packed, model_dir)
    assert "model.safetensors" not in installed and not (model_dir / "model.safetensors").exists()
    assert all(stat.S_IMODE((model_dir / n).stat().st_mode) == 0o644 for n in installed)

    engine = Engine.load(str(model_dir), device="cpu")
    assert engine.sampling_defaults["temperature"] == 0.2 and engine.sampling_defaults["top_p"] == 0.95
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["additional_special_tokens"] == SPECIAL_TOKENS[1:]
    ids = engine.tokenizer.encode(psm_prompt("def f(x):\n", "    return y\n"), add_special=False)
    assert ids[0] == 1 and ids[-1] == 2  # <|fim_prefix|> ... <|fim_middle|>
    *_, done = engine.generate(ids, SamplingParams(max_new_tokens=3))
    assert done.stats.completion_tokens >= 1


def test_function_documents_counts_each_function_once_whatever_the_copies():
    methods = 'class Box:\n    def size(self):\n        """Its size."""\n        return self.n\n'
    keys, texts = ["a.py", "b.py"], [module(0), methods]
    only_extra = function_documents(keys, texts, copies=0, self_contained_copies=3)
    assert (only_extra.found, only_extra.self_contained) == (31, 30)
    assert len(only_extra.texts) == 3 * 30 and all(k.startswith("a.py#") for k in only_extra.keys)
    both = function_documents(keys, texts, copies=2, self_contained_copies=1)
    assert (both.found, both.self_contained) == (31, 30) and len(both.keys) == len(
        set(both.keys)
    ) == 2 * 31 + 30
    assert function_documents(keys, texts, 0, 0).keys == []
