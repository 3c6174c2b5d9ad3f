"""Build the default model in one go on one GPU: corpus, tokenizer, final training (a size sweep on request).

    python -m inference.train_default --out /tmp/default --pack $OUT        # one H200, under 10 minutes
    python -m inference.train_default --out /tmp/default --sweep --pack $OUT   # the size sweep first
    python -m inference.train_default --out /tmp/default --size d512l6 --steps 2400   # the final run alone

Stages, each time-boxed against --budget-minutes (everything, start to written files):
1. corpus (inference/corpus.py): the standard library and the permissively licensed installed
   packages, deduplicated, split by a hash of each path; near duplicates of the old model's test
   files (held_out_minhash.json) left out of training;
2. a byte-level BPE tokenizer trained on a sample of the training files, with <|endoftext|> and the
   three FIM tokens as ids 0-3;
3. the token streams: training files with fill-in-the-middle (inference/fim_training.py, --fim-rate), the
   validation and test files plain;
4. with --sweep only: every --sizes candidate is trained for --sweep-seconds (its step count from a
   timed probe) and the one with the lowest validation loss wins; without it, --size (DEFAULT_SIZE, the
   winner of the last sweep, whose figures the model card keeps) gets the whole budget;
5. the repeat check: two fresh --check-steps runs of the chosen size must agree at every step; the
   second one's steady speed (compiled graphs cached by then) sizes the final run;
6. the final run of the chosen size from a fresh start, its step count filling what is left of the
   budget (or --steps), then the test split's bits per byte and the written checkpoint.

On CUDA the training step is compiled (torch.compile) and every kernel is a deterministic one (strict
torch.use_deterministic_algorithms: attention's backward included). Should the compiler or a kernel
refuse, the repeat check says so and the run goes on without that (eager, or warn-only determinism).
Same corpus, seed, size and --steps: the same curve (the step count a run chose is in training.json
with the command that repeats it). --pack copies the weights' shards (each under 16 MiB) and a tar
of everything else to a folder (scripts/install_default.py unpacks them into models/default).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import platform
import shutil
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from inference import corpus as corpus_lib
from inference.checkpoint import checkpoint_tensors
from inference.fim_training import EOS, SPECIAL_TOKENS, document_segments, encode_segments
from inference.function_examples import documented_functions, is_self_contained
from inference.tokenizer_build import CHAT_TEMPLATES, train_bpe, write_tokenizer_files
from inference.train import (
    WARM_STEPS,
    TrainConfig,
    _check_saved,
    bits_per_byte,
    build_model,
    fit,
    plot_loss,
    set_determinism,
    sync,
)

REPO = Path(__file__).resolve().parents[1]
HELD_OUT_SIGNATURES = Path(__file__).with_name("held_out_minhash.json")

# Candidate sizes: all decode at >= 100 tokens/s at batch 1 on a 2-core CPU (fp32, one thread) with room
# to spare, and weigh under 60 MB in bf16. Name: D and layers. Decode speed against the old 10 M model
# (4 layers, D 384), interleaved runs on the 2-core CPU with random weights: d384l8 0.63, d512l4 0.66,
# d512l6 0.48 of its speed (it makes ~360 tokens/s on an idle machine); each layer costs more than its
# weights alone, so depth is the dearer way to grow.
SIZES: dict[str, dict] = {
    "d384l8": dict(hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2, intermediate_size=1152),
    "d512l4": dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=2048),
    "d512l6": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=1536),
    # for smoke runs on a CPU (tests), not a candidate
    "tiny": dict(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128, sliding_window=16
    ),
}
SWEEP = ("d384l8", "d512l4", "d512l6")
DEFAULT_SIZE = "d512l4"  # the last sweep's winner (models/default/README.md has its figures)
SHARD_BYTES = 12 * 1024**2  # each file moves on its own and stays under a 16 MiB transfer limit
PIECE_CHARS = 3000  # a FIM example (about 900 tokens) fits the 1,024-token context
# The sampling the shipped model is measured with (the card): a repetition penalty of 1.3, since at a
# milder one a quarter or more of its completions loop.
GENERATION = {"do_sample": True, "temperature": 0.2, "top_p": 0.95, "repetition_penalty": 1.3, "max_new_tokens": 256}  # fmt: skip


@dataclasses.dataclass
class Plan:
    out: Path
    pack: Path | None
    budget_minutes: float
    corpus_minutes: float
    encode_by_minutes: float
    sizes: list[str]
    sweep: bool
    size: str
    steps: int
    sweep_seconds: float
    fim_rate: float
    function_copies: int
    self_contained_copies: int
    seed: int
    batch_size: int
    lr: float
    seq_len: int
    vocab_size: int
    tokenizer_sample_mb: float
    stdlib: str
    packages: bool
    device: str
    compile: bool
    check_steps: int
    strict: bool = True  # CUDA: deterministic kernels only (set off by the repeat check if one is missing)


LOG_LINES: list[str] = []  # what log() printed, written to train.log with the checkpoint


def log(message: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {message}"
    LOG_LINES.append(line)
    print(line, flush=True)


class Timeline:
    def __init__(self, budget_minutes: float):
        self.start = time.time()
        self.deadline = self.start + 60 * budget_minutes

    def elapsed(self) -> float:
        return time.time() - self.start

    def left(self) -> float:
        return self.deadline - time.time()


def load_held_out() -> list[np.ndarray]:
    if not HELD_OUT_SIGNATURES.is_file():
        return []
    rows = json.loads(HELD_OUT_SIGNATURES.read_text())["signatures"]
    return [np.array([int(h, 16) for h in row], dtype=np.uint64) for row in rows]


def tokenizer_sample(keys: list[str], texts: list[str], budget: int) -> list[str]:
    """Training texts in the order of a hash of their key, up to `budget` bytes: the same sample on any machine."""
    order = sorted(range(len(keys)), key=lambda i: hashlib.sha256(keys[i].encode()).digest())
    sample, size = [], 0
    for i in order:
        if size >= budget:
            break
        sample.append(texts[i])
        size += len(texts[i])
    return sample


def _functions_of(item: tuple[str, str]) -> list[tuple[str, str]]:
    key, text = item
    return [(f"{key}#{name}", document) for name, document in documented_functions(text)]


@dataclasses.dataclass(frozen=True)
class FunctionDocuments:
    keys: list[str]  # one per copy: "<file key>#<function>@<copy>" (or "@s<copy>" for the extra copies)
    texts: list[str]
    found: int  # distinct short documented functions in the training files
    self_contained: int  # of those, the ones that read only their own names and builtins


def function_documents(
    keys: list[str], texts: list[str], copies: int, self_contained_copies: int = 0
) -> FunctionDocuments:
    """The training files' short documented functions (inference/function_examples.py), each `copies`
    times under its own key (so each copy gets its own FIM cut), the self-contained ones
    `self_contained_copies` times more. Worker processes, forked before CUDA starts; the files' order is kept."""
    if copies <= 0 and self_contained_copies <= 0:
        return FunctionDocuments([], [], 0, 0)
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        found = [
            f
            for per_file in pool.imap(_functions_of, zip(keys, texts, strict=True), chunksize=32)
            for f in per_file
        ]
    out = [(f"{key}@{copy}", document) for copy in range(copies) for key, document in found]
    simple = [(key, document) for key, document in found if is_self_contained(document)]
    out += [(f"{key}@s{copy}", document) for copy in range(self_contained_copies) for key, document in simple]
    return FunctionDocuments(
        [key for key, _ in out], [document for _, document in out], len(found), len(simple)
    )


def stream(
    tok, keys: list[str], texts: list[str], fim_rate: float, seed: int, deadline: float | None = None
) -> tuple[torch.Tensor, int]:
    """(one token stream of the files, each with EOS after it; how many files it holds): encoded in
    batches of about 16 MB, stopping at `deadline` (time.time()) with the files encoded so far."""
    parts, batch, size, done = [], [], 0, 0
    for i, (key, text) in enumerate(zip(keys, texts, strict=True)):
        batch += document_segments(key, text, fim_rate, seed, PIECE_CHARS)
        size += len(text)
        if size >= 16 * 10**6 or i == len(keys) - 1:
            parts.append(encode_segments(tok, batch))
            batch, size, done = [], 0, i + 1
            if deadline is not None and time.time() > deadline and done < len(keys):
                break
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return torch.from_numpy(ids), done


def train_config(plan: Plan, size: str, steps: int, max_minutes: float = 0) -> TrainConfig:
    return TrainConfig(
        out=plan.out, device=plan.device, seed=plan.seed, steps=steps, batch_size=plan.batch_size, lr=plan.lr,
        seq_len=plan.seq_len,
        warmup_steps=min(100, max(1, steps // 10)), eval_every=max(50, steps // 12), compile=plan.compile,
        deterministic=plan.strict, max_minutes=max_minutes, **SIZES[size],
    )  # fmt: skip


def tokens_per_second(plan: Plan, size: str, vocab: int, train_ids, val_ids) -> float:
    """Training speed of `size`: a throwaway model's 10 timed steps after 3 untimed ones (kernel choice and
    allocator warm-up)."""
    c = dataclasses.replace(train_config(plan, size, 3), eval_every=10**9, eval_windows=1)
    _, _, model = build_model(c, vocab, 0, torch.device(plan.device))
    fit(c, model, train_ids, val_ids, say=lambda m: None)
    c = dataclasses.replace(c, steps=10)
    sync()
    start = time.time()
    fit(c, model, train_ids, val_ids, say=lambda m: None)
    sync()
    return c.steps * c.batch_size * c.seq_len / (time.time() - start)


def save_sharded(model, out: Path) -> list[str]:
    """bf16 weights in shards of at most SHARD_BYTES, with the Hub's index file."""
    tensors = {name: t.to(torch.bfloat16).contiguous().cpu() for name, t in checkpoint_tensors(model).items()}
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    files, weight_map = [], {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        (out / file).chmod(0o644)  # safetensors writes 0600; a worker running as another user must read it
        files.append(file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def pack(out: Path, shards: list[str], dest: Path) -> list[str]:
    """The shards as they are and everything else in one tar: few files, each under 16 MiB."""
    dest.mkdir(parents=True, exist_ok=True)
    for shard in shards:
        shutil.copy(out / shard, dest / shard)
    with tarfile.open(dest / "default-rest.tar", "w") as tar:
        for f in sorted(out.iterdir()):
            if f.name not in shards:
                tar.add(f, arcname=f.name)
    return [*shards, "default-rest.tar"]


def repeat_check_runs(plan: Plan, size: str, vocab: int, train_ids, val_ids) -> dict:
    """Two fresh --check-steps runs of `size` from the same seed, compared at every step, and the second's
    steady speed. A compiler failure turns compilation off and a kernel that refuses strict determinism turns
    that off (plan is changed in place, said in the log), and the check runs again: neither costs the model.
    Compiled runs that differ are tried eagerly: the same curve comes before speed."""
    device = torch.device(plan.device)
    compiled_result = None  # the compiled step's check, when it differed
    while True:
        try:
            result = checked_pair(plan, size, vocab, train_ids, val_ids)
        except Exception as exc:  # the compiler's and the deterministic-algorithms errors have no common type
            reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
            if plan.strict and device.type == "cuda" and "determinis" in str(exc):
                plan.strict = False
                log(f"repeatability: a kernel has no deterministic version, running with warnings ({reason})")
            elif plan.compile and device.type == "cuda":
                plan.compile = False
                log(f"torch.compile failed, training eagerly ({reason})")
            else:
                raise
            continue
        if result["identical"] or device.type != "cuda":
            return result
        if plan.compile:
            plan.compile, compiled_result = False, result
            log("repeatability: the compiled step differs; trying it eagerly")
            continue
        if compiled_result is not None:  # eager differs too: compiled, at least it is fast
            plan.compile, plan.strict = True, compiled_result["strict"]
            set_determinism(device, strict=plan.strict)
            return compiled_result
        return result


def checked_pair(plan: Plan, size: str, vocab: int, train_ids, val_ids) -> dict:
    device = torch.device(plan.device)
    set_determinism(device, strict=plan.strict)
    c = dataclasses.replace(train_config(plan, size, plan.check_steps), eval_every=plan.check_steps)
    runs = [
        fit(c, build_model(c, vocab, 0, device)[2], train_ids, val_ids, say=lambda m: None) for _ in range(2)
    ]
    first, second = runs[0].history, runs[1].history
    identical = first["loss"] == second["loss"] and first["val_loss"] == second["val_loss"]
    rate = runs[1].steady_tokens_per_s
    tokens = c.steps * c.batch_size * c.seq_len
    overhead = max(0.0, runs[1].seconds - tokens / rate) if rate else 0.0
    log(f"repeatability: two {c.steps}-step runs {'agree at every step' if identical else 'DIFFER'} "
        f"(compiled: {plan.compile and device.type == 'cuda'}, strict deterministic kernels: "
        f"{plan.strict and device.type == 'cuda'}); {(rate or 0) / 1e3:.0f} k tokens/s after {WARM_STEPS} steps")  # fmt: skip
    return {"steps": c.steps, "identical": identical, "loss": first["loss"][-1], "compiled": plan.compile,
            "strict": plan.strict, "tokens_per_s": rate, "overhead_seconds": overhead}  # fmt: skip


def run(plan: Plan, command: str) -> dict:
    clock = Timeline(plan.budget_minutes)
    device = torch.device(plan.device)

    # 1. corpus
    corpus = corpus_lib.build_corpus(
        plan.stdlib, plan.packages, held_out=load_held_out(),
        deadline=clock.start + 60 * plan.corpus_minutes, exclude_under=[REPO],
    )  # fmt: skip
    summary = corpus.summary()
    log(f"corpus: {summary['files']} files, {summary['bytes'] / 1e6:.0f} MB, {summary['splits']}, fingerprint "
        f"{corpus.fingerprint[:16]}, dropped {summary['dropped']}{' (TRUNCATED)' if corpus.truncated else ''}")  # fmt: skip
    # (CUDA is first touched here: the corpus's worker processes are forked from a process without it)
    log(f"torch {torch.__version__} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
        f"budget {plan.budget_minutes} min, {clock.elapsed():.0f} s used")  # fmt: skip
    keys = {s: corpus.keys(s) for s in ("train", "validation", "test")}
    texts = {s: corpus.texts(s) for s in ("train", "validation", "test")}
    functions = function_documents(
        keys["train"], texts["train"], plan.function_copies, plan.self_contained_copies
    )
    log(f"functions: {functions.found} short documented functions of the training files, {plan.function_copies} "
        f"copies each; {functions.self_contained} self-contained, {plan.self_contained_copies} more copies each; "
        f"{sum(map(len, functions.texts)) / 1e6:.1f} MB in all")  # fmt: skip

    set_determinism(device, strict=plan.strict)

    # 2. tokenizer
    sample = tokenizer_sample(keys["train"], texts["train"], int(plan.tokenizer_sample_mb * 1e6))
    tok = train_bpe(sample, plan.vocab_size, "bytelevel", SPECIAL_TOKENS)
    log(
        f"tokenizer: {tok.get_vocab_size()} tokens from {sum(map(len, sample)) / 1e6:.0f} MB of training files"
    )

    # 3. token streams
    tok.encode_special_tokens = True
    val_ids, _ = stream(tok, keys["validation"], texts["validation"], 0.0, plan.seed)
    test_ids, _ = stream(tok, keys["test"], texts["test"], 0.0, plan.seed)
    deadline = clock.start + 60 * plan.encode_by_minutes
    train_ids, encoded = stream(tok, keys["train"], texts["train"], plan.fim_rate, plan.seed, deadline)
    function_ids, _ = stream(tok, functions.keys, functions.texts, plan.fim_rate, plan.seed)
    train_ids = torch.cat([train_ids, function_ids])
    tok.encode_special_tokens = False
    train_bytes = sum(len(t.encode()) for t in texts["train"][:encoded])
    cut = (
        f" (TRUNCATED at the deadline: {encoded} of {len(keys['train'])} files)"
        if encoded < len(keys["train"])
        else ""
    )
    log(f"tokens: {len(train_ids) / 1e6:.1f} M training, {len(function_ids) / 1e6:.1f} M of them the functions' "
        f"copies ({train_bytes / (len(train_ids) - len(function_ids)):.2f} bytes/token in the files with FIM markers)"
        f"{cut}, {len(val_ids) / 1e6:.2f} M validation, {len(test_ids) / 1e6:.2f} M test")  # fmt: skip
    vocab = tok.get_vocab_size()
    tokens_per_step = plan.batch_size * plan.seq_len

    # 4. sweep
    sweep: list[dict] = []
    chosen, rates = plan.size, {}
    if plan.sweep:
        for size in plan.sizes:
            if sweep and clock.left() < 4 * plan.sweep_seconds + 120:  # the final run's time comes first
                log(f"sweep: {size} skipped, {clock.left():.0f} s left")
                continue
            rates[size] = tokens_per_second(plan, size, vocab, train_ids, val_ids)
            steps = max(20, int(plan.sweep_seconds * rates[size] / tokens_per_step) // 10 * 10)
            c = train_config(plan, size, steps, max_minutes=1.5 * plan.sweep_seconds / 60)
            _, _, model = build_model(c, vocab, 0, device)
            fitted = fit(c, model, train_ids, val_ids, say=lambda m, s=size: log(f"sweep {s}: {m}"))
            params = sum(p.numel() for p in model.parameters())
            sweep.append({"size": size, "parameters": params, "steps": steps, "tokens": steps * tokens_per_step,
                          "probe_tokens_per_s": round(rates[size]), "val_loss": fitted.history["val_loss"][-1],
                          "seconds": round(fitted.seconds, 1), "stopped_early_at_step": fitted.stopped_early})  # fmt: skip
            log(f"sweep {size}: {params / 1e6:.1f} M params, {steps} steps, val {sweep[-1]['val_loss']:.4f}")
            del model
        chosen = min(sweep, key=lambda r: r["val_loss"])["size"]
        log(f"sweep: {chosen} has the lowest validation loss")

    # 5. same seed, same curve; the speed that sizes the final run
    repeat_check = repeat_check_runs(plan, chosen, vocab, train_ids, val_ids) if plan.check_steps else None

    # 6. final run
    reserve = 45.0  # test bits per byte, saving, packing
    steps = plan.steps
    if not steps:
        overhead = repeat_check["overhead_seconds"] if repeat_check else 0.0  # compilation, first steps
        rate = (repeat_check or {}).get("tokens_per_s") or rates.get(chosen)
        rate = rate or tokens_per_second(plan, chosen, vocab, train_ids, val_ids)
        steps = max(50, int((clock.left() - reserve - overhead) * 0.97 * rate / tokens_per_step) // 50 * 50)
        log(f"final: {rate / 1e3:.0f} k tokens/s steady, {overhead:.0f} s to compile and warm up, "
            f"{clock.left():.0f} s left")  # fmt: skip
    c = train_config(plan, chosen, steps, max_minutes=max(1.0, (clock.left() - reserve) / 60))
    hf_config, cfg, model = build_model(c, vocab, 0, device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"final: {chosen}, {n_params / 1e6:.2f} M parameters, {steps} steps of {tokens_per_step} tokens "
        f"({steps * tokens_per_step / 1e6:.0f} M tokens, {steps * tokens_per_step / len(train_ids):.2f} passes)")  # fmt: skip
    fitted = fit(c, model, train_ids, val_ids, say=lambda m: log(f"final: {m}"))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    test_bytes = sum(len(t.encode()) for t in texts["test"])
    try:
        with autocast:
            test_bpb = bits_per_byte(model, test_ids.long(), test_bytes, c.seq_len, c.batch_size)
    except RuntimeError as exc:  # the eager forward's kernels are not those the repeat check ran
        if "determinis" not in str(exc):
            raise
        log(f"test split: a kernel without a deterministic version, measured with warnings ({exc})")
        set_determinism(device, strict=False)
        with autocast:
            test_bpb = bits_per_byte(model, test_ids.long(), test_bytes, c.seq_len, c.batch_size)
    log(f"test split: {test_bpb:.4f} bits per byte over {len(texts['test'])} files")

    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    shards = save_sharded(model, out)
    hf_config["eos_token_id"] = tok.token_to_id(EOS)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"bos_token_id": None, "eos_token_id": [tok.token_to_id(EOS)], **GENERATION}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer_files(out, tok, style="bytelevel", bos=None, eos=EOS, chat_template=CHAT_TEMPLATES["pycomment"],
                          extra_special=SPECIAL_TOKENS[1:], model_max_length=c.seq_len)  # fmt: skip
    _check_saved(out, cfg, model)
    repeat = (f"python -m inference.train_default --out {out} --size {chosen} --steps {steps} --seed {plan.seed} "
              f"--fim-rate {plan.fim_rate} --function-copies {plan.function_copies} --self-contained-copies {plan.self_contained_copies} --batch-size {plan.batch_size} --lr {plan.lr} --seq-len {plan.seq_len} "
              f"--vocab-size {plan.vocab_size} --tokenizer-sample-mb {plan.tokenizer_sample_mb}"
              + ("" if plan.compile else " --no-compile") + ("" if plan.strict else " --no-strict")
              + (f" --stdlib {plan.stdlib}" if plan.stdlib else "") + ("" if plan.packages else " --no-packages"))  # fmt: skip
    result = {
        "command": command,
        "repeat_final_run": repeat,
        "plan": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(plan).items()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(c).items()},
        "size": chosen,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "corpus": summary,
        "corpus_fingerprint": corpus.fingerprint,
        "tokenizer": {
            "vocab_size": vocab,
            "sample_bytes": sum(len(t.encode()) for t in sample),
            "special_tokens": SPECIAL_TOKENS,
        },  # fmt: skip
        "training_tokens": len(train_ids),
        "function_documents": {
            "found": functions.found,
            "copies": plan.function_copies,
            "self_contained": functions.self_contained,
            "self_contained_copies": plan.self_contained_copies,
            "tokens": len(function_ids),
        },
        "training_files_encoded": encoded,
        "training_bytes": train_bytes,
        "parameters": n_params,
        "sweep": sweep,
        "repeat_check": repeat_check,
        "steps": steps,
        "tokens_seen": steps * tokens_per_step,
        "train_seconds": round(fitted.seconds, 1),
        "total_seconds": round(clock.elapsed(), 1),
        "stopped_early_at_step": fitted.stopped_early,
        "final_val_loss": fitted.history["val_loss"][-1],
        "test_bits_per_byte": test_bpb,
        "files": {"validation": keys["validation"], "test": keys["test"]},
        "history": fitted.history,
    }
    (out / "training.json").write_text(json.dumps(result, indent=1) + "\n")
    try:
        plot_loss(fitted.history, out / "loss.png")
    except Exception as exc:  # a missing plotting library must not cost the trained weights
        log(f"loss.png not drawn: {exc}")
    (out / "train.log").write_text("\n".join(LOG_LINES) + "\n")
    packed = pack(out, shards, plan.pack) if plan.pack else []
    size_mb = sum((out / s).stat().st_size for s in shards) / 1e6
    log(f"SUMMARY size {chosen} ({n_params / 1e6:.2f} M params, {size_mb:.1f} MB in {len(shards)} shards), "
        f"{steps} steps, val {result['final_val_loss']:.4f}, test {test_bpb:.4f} bits/byte, "
        f"train {fitted.seconds:.0f} s, total {clock.elapsed():.0f} s; sweep "
        f"{[(r['size'], round(r['val_loss'], 4)) for r in sweep]}; packed {packed}")  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m inference.train_default", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write")
    p.add_argument("--pack", type=Path, help="also copy the shards and a tar of the rest here")
    p.add_argument("--budget-minutes", type=float, default=9.2, help="everything, start to written files")
    p.add_argument("--corpus-minutes", type=float, default=2.5, help="stop examining files after this")
    p.add_argument(
        "--encode-by-minutes", type=float, default=4.0, help="stop tokenizing training files after this"
    )
    p.add_argument("--sweep", action="store_true", help="pick the size by a sweep of --sizes first")
    p.add_argument("--sizes", default=",".join(SWEEP), help="sweep candidates, from: " + ", ".join(SIZES))
    p.add_argument("--size", default=DEFAULT_SIZE, help="the size to train without --sweep")
    p.add_argument("--steps", type=int, default=0, help="final run's steps (0: fill the budget)")
    p.add_argument("--sweep-seconds", type=float, default=30.0, help="training time of each candidate")
    p.add_argument("--fim-rate", type=float, default=0.5)
    p.add_argument("--function-copies", type=int, default=2,
                   help="extra copies of the short documented functions, each a document of its own")  # fmt: skip
    p.add_argument("--self-contained-copies", type=int, default=8,
                   help="more copies of those functions that use only their own names and builtins")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument(
        "--tokenizer-sample-mb",
        type=float,
        default=48.0,
        help="BPE merges settle long before the whole corpus",
    )
    p.add_argument("--stdlib", default="", help="standard library directory (default: this interpreter's)")
    p.add_argument("--no-packages", dest="packages", action="store_false", help="the standard library only")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--check-steps", type=int, default=30, help="repeatability check: two runs this long (0: skip)"
    )
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="CUDA: torch.compile"
    )
    p.add_argument("--strict", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: deterministic kernels only (off: warn and run nondeterministic ones)")  # fmt: skip
    args = p.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    for s in [*sizes, args.size]:
        if s not in SIZES:
            p.error(f"unknown size {s!r}; known: {', '.join(SIZES)}")
    plan = Plan(sizes=sizes, **{k: v for k, v in vars(args).items() if k != "sizes"})
    run(plan, " ".join(["python -m inference.train_default", *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
