"""What one step between phases costs on this GPU, three ways (GPU only): the number a persistent decode kernel
would be designed around.

    python scripts/barrier_probe.py [--programs 132,264] [--rounds 2000] [--json out.json]

  grid barrier   one persistent launch; every round each program adds 1 to a counter (release, GPU scope) and
                 polls it (relaxed loads, then one acquire load) until all programs of the round have arrived
  data flags     one persistent launch; every round each program writes the round number into its own slot
                 (the value is the flag: no fence, no shared counter) and polls all slots until every one
                 shows the round
  PDL chain      what the fast runner does now: a CUDA graph of back-to-back launches of a kernel whose
                 programs wait on the previous one (griddepcontrol.wait) and store one value; also without PDL
Each figure is microseconds per round or per launch: the median of 5 timed repeats after a warm-up.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from inference.bench.model_setup import cuda_missing  # noqa: E402
from inference.bench.timing import median_ms  # noqa: E402


@triton.jit
def _relaxed(ptr):
    return tl.inline_asm_elementwise("ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _acquire(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _grid_barrier_kernel(counter_ptr, rounds):
    programs = tl.num_programs(0)
    for r in range(rounds):
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
        target = (r + 1) * programs
        seen = _relaxed(counter_ptr)
        while seen < target:
            seen = _relaxed(counter_ptr)
        _acquire(counter_ptr)


@triton.jit
def _data_flag_kernel(slots_ptr, rounds, P2: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lanes = tl.arange(0, P2)
    for r in range(rounds):
        tl.store(slots_ptr + pid, r + 1)
        seen = tl.min(
            tl.where(lanes < programs, _relaxed(slots_ptr + tl.minimum(lanes, programs - 1)), r + 1)
        )
        while seen < r + 1:
            seen = tl.min(
                tl.where(lanes < programs, _relaxed(slots_ptr + tl.minimum(lanes, programs - 1)), r + 1)
            )


@triton.jit
def _chain_kernel(out_ptr, USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(out_ptr + tl.program_id(0), tl.program_id(0))


def timed_us(fn, per: int) -> float:
    return median_ms(fn, repeats=5) * 1e3 / per


def probe(programs: int, rounds: int) -> dict:
    device = torch.device("cuda")
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    slots = torch.zeros(programs, dtype=torch.int32, device=device)

    def barrier():
        counter.zero_()
        _grid_barrier_kernel[(programs,)](counter, rounds)

    def flags():
        slots.zero_()
        _data_flag_kernel[(programs,)](slots, rounds, P2=triton.next_power_of_2(programs))

    out = {
        "programs": programs,
        "grid_barrier_us": timed_us(barrier, rounds),
        "data_flags_us": timed_us(flags, rounds),
    }
    sink = torch.zeros(programs, dtype=torch.int32, device=device)
    for pdl in (True, False):
        launches = 200
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            _chain_kernel[(programs,)](sink, USE_PDL=pdl, **({"launch_pdl": True} if pdl else {}))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(launches):
                _chain_kernel[(programs,)](sink, USE_PDL=pdl, **({"launch_pdl": True} if pdl else {}))
        out["pdl_chain_us" if pdl else "stream_chain_us"] = timed_us(graph.replay, launches)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", default="132,264", help="grid sizes (all programs must be resident)")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if cuda_missing("barrier_probe"):
        return 2
    rows = [probe(int(p), args.rounds) for p in args.programs.split(",")]
    print("| programs | grid barrier us | data flags us | PDL launch us | stream-order launch us |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['programs']} | {r['grid_barrier_us']:.2f} | {r['data_flags_us']:.2f} | {r['pdl_chain_us']:.2f} | "
              f"{r['stream_chain_us']:.2f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
