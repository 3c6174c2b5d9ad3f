"""Install what `python -m inference.train_default --pack DIR` wrote into models/default.

    python scripts/install_default.py DIR [--model-dir models/default]

DIR holds the weights' shards (model-0000i-of-0000n.safetensors) and default-rest.tar (config,
tokenizer, generation config, training.json, loss.png, train.log). The old weights are removed
first (a left-over model.safetensors beside new shards would be read as one more shard); the
model card (README.md) stays, it is the repository's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "training.json",
            "loss.png", "train.log", "model.safetensors.index.json"}  # fmt: skip


def install(packed: Path, model_dir: Path) -> list[str]:
    shards = sorted(packed.glob("model-*-of-*.safetensors"))
    rest = packed / "default-rest.tar"
    if not shards or not rest.is_file():
        raise SystemExit(f"{packed}: expected model-*-of-*.safetensors shards and default-rest.tar")
    with tarfile.open(rest) as tar:
        names = set(tar.getnames())
        unknown = names - EXPECTED
        if unknown:
            raise SystemExit(f"{rest}: unexpected members {sorted(unknown)}")
        for old in [*model_dir.glob("model*.safetensors"), *model_dir.glob("model.safetensors.index.json")]:
            old.unlink()
        tar.extractall(model_dir, filter="data")
    for shard in shards:
        shutil.copyfile(shard, model_dir / shard.name)
        (model_dir / shard.name).chmod(0o644)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    missing = set(index["weight_map"].values()) - {s.name for s in shards}
    if missing:
        raise SystemExit(f"the index names shards that were not packed: {sorted(missing)}")
    for f in sorted(names):
        (model_dir / f).chmod(0o644)
    return sorted([*names, *(s.name for s in shards)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packed", type=Path)
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models" / "default")
    args = parser.parse_args(argv)
    args.model_dir.mkdir(parents=True, exist_ok=True)
    for name in install(args.packed, args.model_dir):
        print(args.model_dir / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
