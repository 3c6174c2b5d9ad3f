"""Generate text from the command line, streaming it to stdout as it is produced.

    python -m inference.generate --model tiny-laneformer --prompt "def fib(n):" --max-new-tokens 64

--model takes a checkpoint directory or a synthetic preset name (NAME=DIR names it NAME). With --json, one
JSON object is printed at the end instead. Errors are one line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import sys

from common.events import Done, SamplingParams, TextDelta

EXIT_USAGE, EXIT_FAILED = 2, 1


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m inference.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", help="checkpoint directory or preset (default: the shipped model); NAME=... names it NAME"
    )
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    # Sampling values are checked before the model loads: a bad flag fails in milliseconds.
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    from inference.engine import Engine  # torch loads here

    engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    prompt_ids = engine.encode_prompt(args.prompt, chat=args.chat)
    token_ids: list[int] = []
    for event in engine.generate(prompt_ids, params):
        if isinstance(event, TextDelta):
            token_ids += event.token_ids
            if not args.json and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        elif isinstance(event, Done):
            done = event
    if args.json:
        result = {
            "text": done.text,
            "token_ids": token_ids,
            "prompt_tokens": done.stats.prompt_tokens,
            "completion_tokens": done.stats.completion_tokens,
            "ttft_ms": round(done.stats.ttft_ms, 3),
            "decode_tok_s": round(done.stats.decode_tok_s, 2),
            "decode_steps": done.stats.decode_steps,
            "draft_n": done.stats.draft_n,
            "draft_n_accepted": done.stats.draft_n_accepted,
            "finish_reason": done.finish_reason,
            "model": engine.name,
        }
        print(json.dumps(result, ensure_ascii=False))
    else:
        sys.stdout.write("\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - every failure is reported as one line, never a traceback
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        known = type(e).__module__.startswith(("inference.", "common.")) or isinstance(e, ValueError)
        print(f"error: {message}" if known else f"error: {type(e).__name__}: {message}", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
