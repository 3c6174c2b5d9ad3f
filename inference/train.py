"""Train the shipped default model: a small Laneformer that writes Python, from scratch.

    python -m inference.train --out models/default --device cuda      # one H200: a few minutes
    python -m inference.train --out /tmp/m --device cpu --steps 20     # slowly, anywhere

The corpus is the running interpreter's own standard library (.py files, site-packages excluded;
--corpus names another), split by a hash of each file's relative path, so the split is the same on
every machine: 5% held out for the final figures (eval_default.py), 2% for the validation curve,
the rest for training.
A byte-level BPE tokenizer is trained on the training files, then the model (2 lanes, broadcast
delay 1, windowed first layers) with AdamW and a cosine schedule; bf16 autocast and torch.compile
on CUDA, fp32 on CPU. Same command, seed and device: same loss curve.

Writes the Hugging Face layout to --out (config.json, model.safetensors in bf16, tokenizer files,
generation_config.json) plus training.json (settings, loss curves, split) and loss.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from inference.checkpoint import checkpoint_tensors, load_weights
from inference.config import ModelConfig
from inference.model import Transformer
from inference.tokenizer_build import CHAT_TEMPLATES, train_bpe, write_tokenizer_files

EOS = "<|endoftext|>"
HELD_OUT_PERCENT = 5  # hash buckets 0-4: test files (final figures only)
VALIDATION_PERCENT = 2  # buckets 5-6: the validation curve during training


@dataclass
class TrainConfig:
    out: Path
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    seed: int = 0
    steps: int = 1200
    batch_size: int = 64
    seq_len: int = 1024
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    vocab_size: int = 8192
    hidden_size: int = 384
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 1152
    num_lanes: int = 2
    broadcast_delay: int = 1
    sliding_window: int = 256
    window_layers: int = 2  # the first layers attend to the last `sliding_window` positions only
    eval_every: int = 100
    eval_windows: int = 64  # validation windows of seq_len tokens per evaluation
    max_files: int = 0  # 0: the whole standard library; else the first N files of each split (quick runs)
    compile: bool = True  # CUDA only
    deterministic: bool = True  # CUDA: refuse nondeterministic kernels (off: warn and run them)
    corpus: str = ""  # a standard library directory; empty: the running interpreter's
    max_minutes: float = 0  # 0: no limit; else stop (and say so) when training runs past it


# --- corpus -------------------------------------------------------------------------------------


def stdlib_root(corpus: str = "") -> Path:
    return Path(corpus or sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """Relative POSIX paths of the standard library's .py files, sorted."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    )


def split_of(rel_path: str) -> str:
    """'test', 'validation' or 'train', from a hash of the path: the same on every machine."""
    bucket = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big") % 100
    if bucket < HELD_OUT_PERCENT:
        return "test"
    return "validation" if bucket < HELD_OUT_PERCENT + VALIDATION_PERCENT else "train"


def read_source(root: Path, rel_path: str) -> str:
    return (root / rel_path).read_text(encoding="utf-8", errors="replace")


def corpus_fingerprint(root: Path, files: list[str]) -> str:
    digest = hashlib.sha256()
    for rel in files:
        digest.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return digest.hexdigest()


def token_stream(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    """All texts as one id stream, each followed by EOS (the model learns where a file ends)."""
    ids: list[int] = []
    for encoding in tok.encode_batch(texts, add_special_tokens=False):
        ids += encoding.ids
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


# --- model ----------------------------------------------------------------------------------------


def model_config_json(c: TrainConfig, vocab_size: int, eos_id: int) -> dict:
    return {
        "architectures": ["LaneformerTPForCausalLM"],
        "model_type": "laneformer_tp",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "intermediate_size": c.intermediate_size,
        "vocab_size": vocab_size,
        "num_lanes": c.num_lanes,
        "broadcast_delay": c.broadcast_delay,
        "use_comm": True,
        "use_early_comm": True,
        "lm_head_type": "replicate",
        "pre_norm_lane_agg": False,
        "replicated_rmsn_scale": True,
        "sliding_window": c.sliding_window,
        "sliding_window_n_layers": c.window_layers,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "max_position_embeddings": c.seq_len,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }


def norm_names(model: Transformer) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1].endswith("norm")]


def share_norm_grads(model: Transformer) -> None:
    """replicated_rmsn_scale: one [D] scale serves every lane, but the model holds it as [L, D] rows.
    Giving each row the summed gradient (the shared scale's gradient) keeps the rows equal."""
    params = dict(model.named_parameters())
    for name in norm_names(model):
        g = params[name].grad  # [L, D]
        g.copy_(g.sum(0, keepdim=True).expand_as(g))


# --- training ----------------------------------------------------------------------------------------


def lr_at(step: int, c: TrainConfig) -> float:
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    progress = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def windows(stream: torch.Tensor, seq_len: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` non-overlapping windows of a stream: inputs and targets [count, seq_len]."""
    count = max(1, min(count, (len(stream) - 1) // seq_len))
    chunk = stream[: count * seq_len + 1]
    return chunk[:-1].view(count, seq_len), chunk[1:].view(count, seq_len)


@torch.no_grad()
def bits_per_byte(
    model: Transformer, stream: torch.Tensor, n_bytes: int, seq_len: int, batch_size: int
) -> float:
    """Cross-entropy of a token stream in bits per UTF-8 byte of its text: non-overlapping windows of
    seq_len, every target scored (so a window's first tokens have little context)."""
    device = model.tok_embeddings.device
    n = (len(stream) - 1) // seq_len * seq_len
    x, y = stream[:n].view(-1, seq_len), stream[1 : n + 1].view(-1, seq_len)
    tail_x, tail_y = stream[n:-1][None], stream[n + 1 :][None]  # the last partial window
    nats = 0.0
    for i in range(0, len(x), batch_size):
        logits = model(x[i : i + batch_size].to(device))
        nats += F.cross_entropy(
            logits.flatten(0, 1), y[i : i + batch_size].to(device).flatten(), reduction="sum"
        ).item()
    if tail_x.shape[1]:
        nats += F.cross_entropy(model(tail_x.to(device))[0], tail_y[0].to(device), reduction="sum").item()
    return nats / math.log(2) / n_bytes


def set_determinism(device: torch.device, strict: bool) -> None:
    """CPU kernels are deterministic already; on CUDA ask for the deterministic ones (strict: an op without one
    raises; else it warns, names the op, and runs).

    Only strict mode makes attention's backward deterministic: with warn_only, flash and memory-efficient
    attention warn and keep their atomic-add (split-key) backward, so two runs from one seed drift apart.
    CUBLAS_WORKSPACE_CONFIG must be set before cuBLAS first runs (scripts/train_default.sh exports it)."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=not strict)
        # (compiled kernels follow it too: inductor then skips timing-based choices of reduction configs)
        # Every kernel writes its outputs before reading them, so NaN-filling each new buffer (the mode's
        # default) would cost bandwidth and change nothing.
        torch.utils.deterministic.fill_uninitialized_memory = False


def build_model(
    c: TrainConfig, vocab_size: int, eos_id: int, device: torch.device
) -> tuple[dict, ModelConfig, Transformer]:
    """(config.json's dict, the parsed config, a freshly initialised model) for c's sizes and seed."""
    hf_config = model_config_json(c, vocab_size, eos_id)
    cfg = ModelConfig.from_hf(hf_config)
    model = Transformer(cfg, device=device)
    model.init_weights(generator=torch.Generator(device=device).manual_seed(c.seed))
    return hf_config, cfg, model


@dataclass
class Fitted:
    history: dict  # step, loss, lr, val_step, val_loss
    seconds: float
    stopped_early: int | None  # the step --max-minutes stopped at
    steady_tokens_per_s: float | None = None  # after the first steps (compilation, allocator warm-up)


WARM_STEPS = 5  # steps left out of the steady speed: compilation and autotuning happen in them


def training_loss(model: Transformer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of inputs x against targets y, both [B, T]."""
    logits = model(x)  # [B, T, V] fp32
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def fit(
    c: TrainConfig, model: Transformer, train_ids: torch.Tensor, val_ids: torch.Tensor, say=None
) -> Fitted:
    """Train `model` in place for c.steps steps of c.batch_size random windows of train_ids (a token
    stream), validating on the first c.eval_windows windows of val_ids every c.eval_every steps."""
    say = say or log
    device = model.tok_embeddings.device
    torch.manual_seed(c.seed)
    norms = set(norm_names(model))
    decay = [p for n, p in model.named_parameters() if n not in norms]
    no_decay = [p for n, p in model.named_parameters() if n in norms]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=c.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
    )  # fmt: skip

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return training_loss(model, x, y)

    on_cuda = device.type == "cuda"
    step_loss = loss_fn
    if on_cuda and c.compile:
        # Each run compiles afresh: graphs of earlier runs' models would otherwise count against dynamo's
        # recompile limit (past it, a run silently falls back to eager); inductor's on-disk cache keeps a
        # second compilation of the same graph short.
        # imported here, not with the module: dynamo loads triton, which then fixes its interpreter switch
        from torch import _dynamo

        _dynamo.reset()
        step_loss = torch.compile(loss_fn)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda)

    train_ids = train_ids.to(device)
    val_x, val_y = (t.to(device).long() for t in windows(val_ids, c.seq_len, c.eval_windows))
    positions = torch.arange(c.seq_len + 1, device=device)
    batch_gen = torch.Generator().manual_seed(c.seed + 1)  # batches: CPU generator, same on every device

    @torch.no_grad()
    def validation_loss() -> float:
        with autocast:
            losses = [step_loss(val_x[i : i + c.batch_size], val_y[i : i + c.batch_size])
                      for i in range(0, len(val_x), c.batch_size)]  # fmt: skip
        return float(torch.stack(losses).mean())

    history = {"step": [], "loss": [], "lr": [], "val_step": [], "val_loss": []}
    pending: list[torch.Tensor] = []
    t_train = t_warm = time.time()
    eval_seconds = 0.0  # validation after the warm-up steps: not part of the steady training speed
    stopped_early = None
    for step in range(c.steps):
        lr = lr_at(step, c)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_ids) - c.seq_len - 1, (c.batch_size,), generator=batch_gen)
        chunk = train_ids[starts.to(device)[:, None] + positions].long()  # [B, T+1]
        with autocast:
            loss = step_loss(chunk[:, :-1], chunk[:, 1:])
        loss.backward()
        share_norm_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        pending.append(loss.detach())
        history["step"].append(step)
        history["lr"].append(lr)

        last = step == c.steps - 1
        over_time = c.max_minutes and time.time() - t_train > 60 * c.max_minutes
        evaluate = (step + 1) % c.eval_every == 0 or last or over_time
        if (step + 1) % 10 == 0 or evaluate:
            history["loss"] += torch.stack(pending).float().tolist()  # one host sync per 10 steps
            pending.clear()
        if evaluate:
            sync()
            t_eval = time.time()
            val = validation_loss()
            if step + 1 > WARM_STEPS:
                eval_seconds += time.time() - t_eval
            history["val_step"].append(step)
            history["val_loss"].append(val)
            tokens_per_s = (step + 1) * c.batch_size * c.seq_len / (time.time() - t_train)
            say(f"step {step + 1:5d}/{c.steps}  loss {history['loss'][-1]:.4f}  val {val:.4f}  "
                f"lr {lr:.2e}  {tokens_per_s / 1e3:.0f} k tok/s  {time.time() - t_train:.0f} s")  # fmt: skip
        if step + 1 == WARM_STEPS:
            sync()
            t_warm = time.time()
        if over_time and not last:
            stopped_early = step + 1
            say(f"stopping at step {step + 1}: past --max-minutes {c.max_minutes}")
            break
    sync()
    steps_done = len(history["step"])
    steady = None
    if steps_done > WARM_STEPS:
        steady = (steps_done - WARM_STEPS) * c.batch_size * c.seq_len / (time.time() - t_warm - eval_seconds)
    return Fitted(history, time.time() - t_train, stopped_early, steady)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train(c: TrainConfig, command: str = "") -> dict:
    t_start = time.time()
    device = torch.device(c.device)
    set_determinism(device, c.deterministic)

    root = stdlib_root(c.corpus)
    files = stdlib_files(root)
    if not files:
        raise SystemExit(f"--corpus: no .py files under {root}")
    split = {f: split_of(f) for f in files}
    limit = c.max_files or None
    train_files = [f for f in files if split[f] == "train"][:limit]
    val_files = [f for f in files if split[f] == "validation"][:limit]
    test_files = [f for f in files if split[f] == "test"][:limit]
    train_texts = [read_source(root, f) for f in train_files]
    val_texts = [read_source(root, f) for f in val_files]
    fingerprint = corpus_fingerprint(root, files)
    log(f"corpus: {root} (fingerprint {fingerprint[:16]}): {len(train_files)} training files "
        f"({sum(map(len, train_texts)) / 1e6:.1f} M chars), {len(val_files)} validation, {len(test_files)} test")  # fmt: skip

    tok = train_bpe(train_texts, c.vocab_size, "bytelevel", [EOS])
    eos_id = tok.token_to_id(EOS)
    train_ids = token_stream(tok, train_texts, eos_id)
    val_ids = token_stream(tok, val_texts, eos_id)
    log(f"tokenizer: {tok.get_vocab_size()} tokens; {len(train_ids) / 1e6:.2f} M training tokens "
        f"({sum(len(t.encode()) for t in train_texts) / len(train_ids):.2f} bytes/token)")  # fmt: skip

    torch.manual_seed(c.seed)
    hf_config, cfg, model = build_model(c, tok.get_vocab_size(), eos_id, device)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"model: {n_params / 1e6:.2f} M parameters, {c.num_layers} layers x {c.num_lanes} lanes, D {c.hidden_size}"
    )
    fitted = fit(c, model, train_ids, val_ids)
    history, train_seconds, stopped_early = fitted.history, fitted.seconds, fitted.stopped_early
    on_cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda)
    test_texts = [read_source(root, f) for f in test_files]
    with autocast:
        test_bpb = bits_per_byte(model, token_stream(tok, test_texts, eos_id), sum(len(t.encode()) for t in test_texts),
                                 c.seq_len, c.batch_size)  # fmt: skip
    log(f"test split: {test_bpb:.4f} bits per byte over {len(test_files)} held-out files")

    out = Path(c.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in checkpoint_tensors(model).items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"bos_token_id": None, "eos_token_id": [eos_id], "do_sample": False, "max_new_tokens": 256}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer_files(out, tok, style="bytelevel", bos=None, eos=EOS, chat_template=CHAT_TEMPLATES["pycomment"],
                          model_max_length=c.seq_len)  # fmt: skip
    _check_saved(out, cfg, model)

    summary = {
        "command": command,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(c).items()},
        "python": platform.python_version(),
        "corpus": str(root),
        "corpus_fingerprint": fingerprint,  # sha256 over every file's path and bytes: same corpus, same hash
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or "cpu",
        "parameters": n_params,
        "training_tokens": len(train_ids),
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "stopped_early_at_step": stopped_early,
        "final_val_loss": history["val_loss"][-1],
        "test_bits_per_byte": test_bpb,
        "files": {"train": len(train_files), "validation": val_files, "test": test_files},
        "history": history,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_loss(history, out / "loss.png")
    log(f"wrote {out} in {summary['total_seconds']:.0f} s (training {train_seconds:.0f} s)")
    return summary


def _check_saved(out: Path, cfg: ModelConfig, model: Transformer) -> None:
    """Read the checkpoint back through the engine's loader: names, shapes and values must round-trip."""
    loaded = load_weights(out, cfg, "cpu", torch.bfloat16)
    for name, p in model.state_dict().items():
        if name in loaded and not torch.equal(loaded[name], p.detach().to("cpu", torch.bfloat16)):
            raise RuntimeError(f"{name}: saved weights differ from the trained ones")


def plot_loss(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(
        [s + 1 for s in history["step"][: len(history["loss"])]], history["loss"], lw=0.8, label="training"
    )
    ax.plot([s + 1 for s in history["val_step"]], history["val_loss"], "o-", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def log(message: str) -> None:
    print(message, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.train", description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "out":
            parser.add_argument(flag, type=Path, required=True)
        elif f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type]
            parser.add_argument(flag, type=kind, default=f.default)
    args = parser.parse_args(argv)
    c = TrainConfig(**vars(args))
    if c.device not in ("cpu", "cuda"):
        parser.error(f"--device: must be cpu or cuda, got {c.device!r}")
    if c.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device: cuda was asked for but no CUDA GPU is available")
    train(c, command=" ".join(["python -m inference.train", *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
