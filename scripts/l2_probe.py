"""Does a prefetch into L2 make a later read faster on this GPU, and what does issuing it cost? (GPU only)

    python scripts/l2_probe.py [--mib 16,32] [--json out.json]

A buffer of W MiB is read by a streaming kernel (evict-first loads, as the decode kernels read weights):
  cold        after a 1 GiB read that flushes L2
  warm        right after the same read (what L2 holds of it)
  bulk        after cp.async.bulk.prefetch.L2 over the buffer (one piece a thread), synchronized
  line-128 / line-32 / line-128-last
              after per-thread prefetch.global.L2 every 128 or 32 bytes (::evict_last in the third)
For each prefetch also: how long the prefetch kernel itself takes (does a program wait for its prefetches
before it can exit?), and prefetch + read launched back to back without a sync. Microseconds, median of 7.

On the H200 (kernels/NOTES.md, round 5) a warm read of 16-32 MiB was no faster than a cold one (7.5 vs 7.6 us,
11.1 vs 11.2 us): a streaming read is limited by what the programs keep in flight, not by where the bytes sit,
which is why prefetching a later kernel's weights into L2 did not pay in the decode step.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from inference.bench.model_setup import cuda_missing  # noqa: E402
from inference.bench.timing import median_ms  # noqa: E402

BLOCK = 8192  # elements a read program sums
# Per-thread prefetch of the line holding an address, predicated on $2: plain, and with L2::evict_last.
LINE_PREFETCH = tl.constexpr(
    (
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.b32 $0, 0; }",
    )
)


@triton.jit
def _read_kernel(w_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(w_ptr + offs, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(w, axis=0))


@triton.jit
def _bulk_kernel(w_ptr, nbytes, THREADS: tl.constexpr):
    """Each program asks for an even share of the buffer, one contiguous piece a thread (sizes in 16 bytes, as
    cp.async.bulk.prefetch.L2 requires; no registers, no waiting)."""
    share = tl.cdiv(tl.cdiv(nbytes, tl.num_programs(0)), 16 * THREADS) * 16 * THREADS
    piece = share // THREADS
    start = tl.program_id(0).to(tl.int64) * share + tl.arange(0, THREADS).to(tl.int64) * piece  # [THREADS]
    size = tl.minimum(tl.maximum(nbytes - start, 0), piece).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r",
        [w_ptr.to(tl.pointer_type(tl.int8)) + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _line_kernel(w_ptr, nbytes, STRIDE: tl.constexpr, THREADS: tl.constexpr, EVICT_LAST: tl.constexpr):
    base = w_ptr.to(tl.pointer_type(tl.int8))
    step = tl.num_programs(0).to(tl.int64) * THREADS * STRIDE
    start = (tl.program_id(0).to(tl.int64) * THREADS + tl.arange(0, THREADS)) * STRIDE
    for first in range(0, nbytes, step):
        offs = first + start
        ok = (offs < nbytes).to(tl.int32)
        tl.inline_asm_elementwise(LINE_PREFETCH[EVICT_LAST], "=r,l,r", [base + offs, ok], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


def timed(fn, before) -> float:
    """Median microseconds of fn() after before() (untimed), the host's launch time not counted."""
    return median_ms(fn, repeats=7, before=before) * 1e3


def probe(mib: int, sms: int, flush) -> dict:
    w = torch.randn(mib << 19, dtype=torch.bfloat16, device="cuda")
    nbytes = w.numel() * 2
    out = torch.empty(w.numel() // BLOCK, dtype=torch.float32, device="cuda")

    def read() -> None:
        _read_kernel[(w.numel() // BLOCK,)](w, out, BLOCK=BLOCK, num_warps=8)

    def lines(stride: int, evict_last: bool):
        return lambda: _line_kernel[(sms,)](w, nbytes, STRIDE=stride, THREADS=128, EVICT_LAST=evict_last,
                                            num_warps=4)  # fmt: skip

    prefetches = {
        "bulk": lambda: _bulk_kernel[(sms,)](w, nbytes, THREADS=128, num_warps=4),
        "line-128": lines(128, False),
        "line-32": lines(32, False),
        "line-128-last": lines(128, True),
    }
    row = {"mib": mib, "cold_us": timed(read, flush), "warm_us": timed(read, read)}
    for name, prefetch in prefetches.items():

        def prefetched(prefetch=prefetch) -> None:
            flush()
            prefetch()
            torch.cuda.synchronize()

        def both(prefetch=prefetch) -> None:
            prefetch()
            read()

        row[f"{name}_read_us"] = timed(read, prefetched)
        row[f"{name}_issue_us"] = timed(prefetch, flush)
        row[f"{name}_then_read_us"] = timed(both, flush)
    hbm = nbytes / row["cold_us"] / 1e3
    print(f"{mib} MiB: cold {row['cold_us']:.1f} us ({hbm:,.0f} GB/s), warm {row['warm_us']:.1f} us")
    for name in prefetches:
        print(f"  {name:<14} read after it {row[f'{name}_read_us']:6.1f} us   the prefetch kernel "
              f"{row[f'{name}_issue_us']:6.1f} us   both back to back {row[f'{name}_then_read_us']:6.1f} us")  # fmt: skip
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", default="16,32")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if cuda_missing("l2_probe"):
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    junk = torch.ones(1 << 29, dtype=torch.bfloat16, device="cuda")  # 1 GiB

    def flush() -> None:
        junk.sum()

    results = [probe(int(m), sms, flush) for m in args.mib.split(",")]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
