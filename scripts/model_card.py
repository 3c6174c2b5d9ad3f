"""Write models/default/README.md (the model card) from what training and evaluation recorded.

    python -m inference.eval_default --model models/default --json > /tmp/new.json
    python -m inference.eval_default --model /tmp/old-default --json > /tmp/old.json   # the model it replaces
    python scripts/model_card.py --new /tmp/new.json --old /tmp/old.json [--machine "this project's 2-core CPU"]
        [--first /tmp/first.json]   # a column for the first default model too (10 M, the standard library alone)

Everything in the card comes from models/default's config.json, generation_config.json and
training.json and from the two evaluations, so the card says what the files say.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The first default model's figures as its card gave them (eval_default of that time), for what the old
# evaluation did not measure again.
OLD_CARD = {"bits_per_byte": 0.9855, "parse_share": 0.62, "decode_tok_s": 360.0}
FIRST_MODEL = "the first default model (4 layers, D 384, 10 M parameters, the standard library alone, no FIM)"
OLD_MODEL = "the model it replaces (the same recipe without the function documents: d512l4, 537 M tokens)"

# The short sweep behind generation_config.json's repetition penalty (eval_default --only sampled --sampling
# repetition_penalty=X at the page's temperature 0.2 and top-p 0.95): penalty -> (loop share, parse share).
PENALTY_SWEEP = {
    1.1: (0.35, 0.90),
    1.15: (0.25, 0.90),
    1.2: (0.20, 0.80),
    1.25: (0.05, 0.80),
    1.3: (0.05, 0.90),
    1.35: (0.0, 0.85),
    1.4: (0.0, 0.80),
}

# The last size sweep (`--sweep`: each candidate trained for about 30 s on one H200, validation loss): a run
# that trains the default size without sweeping again shows these.
LAST_SWEEP = [
    {"size": "d384l8", "parameters": 16_921_344, "steps": 260, "tokens": 17_039_360, "val_loss": 4.9129},
    {"size": "d512l4", "parameters": 19_407_872, "steps": 360, "tokens": 23_592_960, "val_loss": 3.6394},
    {"size": "d512l6", "parameters": 22_295_552, "steps": 270, "tokens": 17_694_720, "val_loss": 4.6999},
]


def percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def number(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def figure_cells(e: dict, first: bool = False) -> list[str]:
    """One model's column: its eval_default --json figures (the first model's card fills what is missing)."""
    card = OLD_CARD if first else {}
    fim = (lambda k: percent(e.get(k))) if "fim_parse_share" in e else (lambda k: "no FIM tokens")
    return [percent(e.get("loop_share")), percent(e.get("sampled_parse_share")), percent(e.get("unit_test_share")),
            fim("fim_parse_share"), fim("fim_raw_parse_share"), fim("fim_ended_share"), fim("fim_exact_share"),
            percent(e.get("parse_share", card.get("parse_share"))),
            number(e.get("bits_per_byte", card.get("bits_per_byte"))), number(e.get("decode_tok_s"), 0)]  # fmt: skip


ROWS = [
    "loops at the page's sampling (20 prompts; goal <= 10%)",
    "sampled completions that parse (goal >= 80%)",
    "simple functions whose greedy body passes its unit test (16; goal >= 25%)",
    "fill-in-the-middle: filled held-out functions that parse (40; goal >= 70%)",
    "fill-in-the-middle: the same, the middle as generated (no client stop)",
    "fill-in-the-middle: the middle ended by `<\\|endoftext\\|>` itself",
    "fill-in-the-middle: filled exactly",
    "held-out functions, greedy completions that parse (50)",
    "bits per byte, the old test split (88 standard-library files; goal < 0.9855)",
    "decode tokens/s, batch 1, CPU, median (goal >= 100)",
]


def figures_table(new: dict, old: dict, first: dict | None = None) -> str:
    columns = [[f"**{c}**" for c in figure_cells(new)], figure_cells(old)]
    titles = ["this model", "the model it replaces"]
    if first is not None:
        columns.append(figure_cells(first, first=True))
        titles.append("the first default model")
    lines = ["| | " + " | ".join(titles) + " |", "| --- |" + " --- |" * len(titles)]
    lines += ["| " + " | ".join([row, *cells]) + " |" for row, *cells in zip(ROWS, *columns, strict=True)]
    return "\n".join(lines)


def packages_table(packages: list[dict]) -> tuple[str, str]:
    kept = [p for p in packages if p["permissive"] and p["files"]]
    left = [p for p in packages if not p["permissive"]]
    rows = ["| package | version | licence | files | MB |", "| --- | --- | --- | --- | --- |"]
    rows += [
        f"| {p['name']} | {p['version']} | {p['licence'][:80]} | {p['files']:,} | {p['bytes'] / 1e6:.1f} |"
        for p in kept
    ]
    out = ", ".join(f"{p['name']} {p['version']} ({p['licence'][:60]})" for p in left) or "none"
    return "\n".join(rows), out


def card(model_dir: Path, new: dict, old: dict, machine: str, first: dict | None = None) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    training = json.loads((model_dir / "training.json").read_text())
    corpus, settings, plan = training["corpus"], training["settings"], training["plan"]
    params = training["parameters"]
    weights = sorted(model_dir.glob("*.safetensors"))
    weight_mb = sum(w.stat().st_size for w in weights) / 1e6
    kept_table, left_out = packages_table(corpus["packages"])
    layers, window_layers = config["num_hidden_layers"], config["sliding_window_n_layers"]
    swept = bool(training["sweep"])
    sweep_rows = "\n".join(
        f"| {r['size']} | {r['parameters'] / 1e6:.1f} M | {r['steps']:,} | {r['tokens'] / 1e6:.0f} M | {r['val_loss']:.4f} |"
        for r in training["sweep"] or LAST_SWEEP
    )  # fmt: skip
    sweep_when = (
        "in this run"
        if swept
        else "in an earlier run of the recipe (`--sweep`); this run did not repeat it and"
        " gave the whole budget to the final run of the winner"
    )
    compiled, strict = plan.get("compile", False), plan.get("strict", False)
    repeat = training.get("repeat_check") or {}
    penalties = "; ".join(f"{k}: {a:.0%} loop, {b:.0%} parse" for k, (a, b) in PENALTY_SWEEP.items())
    speed_note = (
        f"; the second one's steady speed ({repeat['tokens_per_s'] / 1e3:.0f} k tokens/s) set the final run's length"
        if repeat.get("tokens_per_s")
        else ""
    )
    step_how = ", ".join(
        [*(["the step compiled by `torch.compile`"] if compiled else []),
         *(["deterministic kernels only (strict `torch.use_deterministic_algorithms`, attention's backward included)"] if strict else [])]
    )  # fmt: skip
    sampling = ", ".join(
        f"{k} {generation[k]}" for k in ("temperature", "top_p", "repetition_penalty") if k in generation
    )
    dropped = ", ".join(f"{reason} {count:,}" for reason, count in corpus["dropped"].items())
    functions = training.get("function_documents") or {}
    functions_step = (
        f"""3. function documents ([`inference/function_examples.py`](../../inference/function_examples.py)): every
   function or method of the training files with a docstring and a body of at most 12 lines after it
   ({functions["found"]:,} of them) also becomes a document of its own, dedented, its docstring cut to its first
   paragraph on one line, the shape of a `def` prompt with a docstring; abstract bodies (`pass`, `...`,
   `raise NotImplementedError`) are left out. Each is added {functions["copies"]} times, and the
   {functions["self_contained"]:,} self-contained ones (plain functions that read only their own names and
   builtins) {functions["self_contained_copies"]} times more, each copy with its own FIM cut at the same
   rate: {functions["tokens"] / 1e6:.1f} M of the training tokens;
"""
        if functions
        else ""
    )
    step = iter(range(3 + bool(functions), 10))
    ended = new.get("fim_ended_share")
    ending = (
        f"it ends {percent(ended)} of the greedy middles above with `<|endoftext|>` by itself; for the others"
        if ended is not None and ended >= 0.3
        else f"it seldom ends the middle with `<|endoftext|>` by itself ({percent(ended)} of the greedy middles above):"
    )
    return f"""# default: a {params / 1e6:.0f} M-parameter Laneformer that writes and fills in Python

The model the playground, the CLI and the worker run when no other model is named, and the one every
end-to-end test and CI run uses. It is trained from scratch by this repository
([`inference/train_default.py`](../../inference/train_default.py)) on permissively licensed Python that
was already installed on the training machine (the standard library and the installed packages'
sources), so it needs nothing downloaded, and it is small enough to stream code in real time on a
2-core CPU. It is a real Laneformer (`model_type: laneformer_tp`): {config["num_lanes"]} lanes, broadcast delay
{config["broadcast_delay"]}, the first {window_layers} of {layers} layers windowed, so it runs the same code path as the 2B
model, only smaller. It is a base model: it continues code, and it fills in the middle.

| | |
| --- | --- |
| architecture | Laneformer, {layers} layers, {config["num_lanes"]} lanes, broadcast delay {config["broadcast_delay"]} (`use_comm`, `use_early_comm`), D {config["hidden_size"]}, {config["num_attention_heads"]} query / {config["num_key_value_heads"]} KV heads (head dim {config["hidden_size"] // config["num_attention_heads"]}), FFN {config["intermediate_size"]}, RoPE theta {config["rope_theta"]:,.0f}, RMSNorm with a shared scale (`replicated_rmsn_scale`), replicated head tied to the embedding |
| attention | layers 0-{window_layers - 1}: sliding window of {config["sliding_window"]} positions; the others full causal; context {config["max_position_embeddings"]:,} |
| parameters | {params:,} ({params / 1e6:.1f} M) while training (each lane holds its own copy of the shared norm scales) |
| weights | {len(weights)} safetensors shards (`model.safetensors.index.json`), bf16, {weight_mb:.1f} MB |
| tokenizer | byte-level BPE, {training["tokenizer"]["vocab_size"]:,} tokens, trained by `tokenizers` on {training["tokenizer"]["sample_bytes"] / 1e6:.0f} MB of the training files (Llama 3's pre-tokenizer regex); `<\\|endoftext\\|>` (id 0) ends a file and stops generation, `<\\|fim_prefix\\|>`, `<\\|fim_middle\\|>`, `<\\|fim_suffix\\|>` (ids 1-3) mark fill-in-the-middle; no BOS |
| fill-in-the-middle | `<\\|fim_prefix\\|>` prefix `<\\|fim_suffix\\|>` suffix `<\\|fim_middle\\|>`: the model writes the middle and ends it with `<\\|endoftext\\|>` (trained in PSM and SPM order, see below) |
| chat template | `pycomment`: a request in words becomes `# ` comment lines and the model continues with code; a user message that already is code (`def`, `class`, `import`, ...) goes in verbatim |
| sampling defaults | `generation_config.json`: {sampling}, up to {generation.get("max_new_tokens")} new tokens; the page shows the temperature and top-p it recommends |

## Data

All `.py` files of the standard library of the training machine's **Python {training["python"]}** and of the
installed distributions whose licence is permissive ([`inference/corpus.py`](../../inference/corpus.py)):
a distribution's files come from its `RECORD`, its licence from its metadata (`License-Expression`, else
the licence classifiers, all of which must be permissive, else the `License` field). Files were then
dropped for being vendored copies, over 256 KB or nearly empty, not UTF-8, generated tables, exact or near
duplicates (MinHash of the set of stripped lines, estimated Jaccard >= 0.8; the standard library's copy
stays), or near duplicates of the old model's 88 held-out files: {dropped}.

**{corpus["files"]:,} files, {corpus["bytes"] / 1e6:.0f} MB** remain; fingerprint (SHA-256 over every file's key and
bytes) `{training["corpus_fingerprint"]}`. Each file's split comes from a hash of its path relative to its
root (`sha256(path) mod 100`: 0-4 test, 5-6 validation, the rest training), as before, so the standard
library's files keep the split they had: {", ".join(f"{k} {v:,}" for k, v in corpus["splits"].items())} files;
{training["training_tokens"] / 1e6:.0f} M training tokens with the FIM markers.

Packages used (name, version, licence as its metadata gives it, files and MB kept):

{kept_table}

Left out for their licence: {left_out}.

## Training

On one {training["device"]} (torch {training["torch"]}, Python {training["python"]}), in one command of
{training["total_seconds"]:.0f} s from an empty output folder to the written checkpoint:

```
{training["command"]}
```

1. corpus and tokenizer as above;
2. fill-in-the-middle: each file is cut at line ends into pieces of at most 3,000 characters; each piece
   becomes a FIM example with probability {plan["fim_rate"]} (half of them in PSM order,
   `<|fim_prefix|>` prefix `<|fim_suffix|>` suffix `<|fim_middle|>` middle `<|endoftext|>`, half in SPM
   order, `<|fim_prefix|><|fim_suffix|>` suffix `<|fim_middle|>` prefix middle `<|endoftext|>`), cut at line
   starts half of the time and at any character otherwise ([`inference/fim_training.py`](../../inference/fim_training.py));
{functions_step}{next(step)}. the size sweep, on the validation split, {sweep_when}: each candidate trained for about 30 s from a fresh
   start (its step count from a timed probe), the lowest validation loss wins. All candidates decode at
   100+ tokens/s on a 2-core CPU and weigh under 60 MB.

| size | parameters | steps | tokens | validation loss |
| --- | --- | --- | --- | --- |
{sweep_rows}

{next(step)}. the repeat check: two fresh {repeat.get("steps", "?")}-step runs of the chosen size from the same seed, compared
   at every step{speed_note};
{next(step)}. the final run of **{training["size"]}** from a fresh start: {training["steps"]:,} steps of {settings["batch_size"]} x {settings["seq_len"]:,} tokens
   ({training["tokens_seen"] / 1e6:.0f} M tokens, {training["tokens_seen"] / training["training_tokens"]:.2f} passes over the training tokens), the step count filling
   what was left of a {plan["budget_minutes"]} minute budget; AdamW (betas 0.9/0.95, weight decay {settings["weight_decay"]} on matrices),
   learning rate {settings["lr"]} with {settings["warmup_steps"]} warm-up steps and a cosine decay to {settings["lr"] * settings["min_lr_ratio"]:.0e}, gradient clipping
   at {settings["grad_clip"]}, bf16 autocast{", " + step_how if step_how else ""}, seed {settings["seed"]}. Training took **{training["train_seconds"]:.0f} s**; final validation loss
   {training["final_val_loss"]:.3f} nats/token, {training["test_bits_per_byte"]:.4f} bits per byte on the new test split.

![loss curve](loss.png)

**{"Reproducible." if repeat.get("identical") else "Not yet bit-reproducible."}** `training.json` holds the settings, the curves, the sweep, the corpus summary and the
command that repeats the final run alone (`{training["repeat_final_run"]}`). Same corpus, seed and step
count on the same device: the same curve. The run checked it: two fresh {repeat.get("steps", "?")}-step runs of the chosen
size {"agreed at every step" if repeat.get("identical") else "DID NOT agree"} (CUDA runs ask for deterministic kernels{" strictly" if strict else ""} and set
`CUBLAS_WORKSPACE_CONFIG` before CUDA starts). Another GPU model, driver or torch version, or another set of installed
packages (another corpus: see the fingerprint), gives another model.

## Figures

Measured with `python -m inference.eval_default` on {machine} (fp32, one thread, the engine's reference
path), against {OLD_MODEL}{" and " + FIRST_MODEL if first is not None else ""}. Decode speed counts the
engine's speculative drafting (prompt lookup): text that repeats itself exactly decodes in fewer steps, so
a model that loops less exactly on the speed prompt shows fewer tokens/s at the same cost per step:

{figures_table(new, old, first)}

The prompts and unit tests of the first rows are this project's own (`inference/eval_prompts.py`), not
taken from any corpus. Loops: a completion of up to 256 tokens loops when a line of 3+ words recurs 3+
times or fewer than half of its word 4-grams are distinct. Parsing: the prompt plus the completion cut where
a code-completion evaluator's stop sequences would cut it (the end of the function or method the prompt
opened); one the token limit cut first is judged on the statements it finished. Simple functions: clamp, gcd, factorial, is_prime, fibonacci, ... with the greedy body run
against one `assert` line in a separate, resource-limited interpreter. Fill-in-the-middle: held-out
functions (the old test split) with one statement of their body removed, filled greedily; the middle is
stopped as a completion client stops it (a line at column 0 has left the function; a middle the token
limit cut loses its unfinished last line), and the rows below it give the middles as generated. The held-out files are the old
model's test split (the standard library of CPython 3.11.7); their near duplicates were kept out of
training. The earlier models' figures were measured again with today's `eval_default`.

The repetition penalty in `generation_config.json` is the one of a short sweep at the page's temperature and
top-p: the one with the most completions that parse while at most 10% loop. {penalties}.

## How to reproduce

```
OUT=/tmp/packed bash scripts/train_default.sh          # on one H200: under 10 minutes
python scripts/install_default.py /tmp/packed          # into models/default
python -m inference.eval_default --model models/default  # the figures above, on CPU
```

## Limits

- It is small: it writes plausible Python, often with invented names and wrong logic; the repetition
  penalty keeps it from looping but cannot make it right. It is a demo of speed, not a coding assistant.
- Filling in the middle, {ending} a client stops it (at the end of the enclosing block) or gives it a
  token limit.
- It is a base model: it continues code. The chat template turns a request into a comment, which it
  may or may not follow; a `def` line with a docstring works best.
- The context is {config["max_position_embeddings"]:,} tokens (prompt and completion together); positions past that were
  never trained. The engine refuses longer prompts.
- It learned from what one machine had installed, much of it scientific and machine-learning code
  (torch, transformers, scipy, sympy, ...): it writes that kind of code more readily than, say, web code.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=Path, required=True, help="eval_default --json of this model")
    parser.add_argument("--old", type=Path, help="eval_default --json of the model it replaces")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models" / "default")
    parser.add_argument(
        "--first", type=Path, help="eval_default --json of the first default model (a column)"
    )
    parser.add_argument("--machine", default="this project's 2-core CPU")
    args = parser.parse_args(argv)

    def figures(path: Path | None) -> dict | None:
        return json.loads(path.read_text().strip().splitlines()[-1]) if path else None

    new, old, first = figures(args.new), figures(args.old) or {}, figures(args.first)
    (args.model_dir / "README.md").write_text(card(args.model_dir, new, old, args.machine, first))
    print(args.model_dir / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
