"""Can a persistent kernel keep the weight stream going through a layer's phase boundaries? (GPU only; Hopper.)

The premise of the design kernels/NOTES.md pointed at for qwen3-1.7b's last 7% (rounds 11 and 25): the weights do
not depend on the token, so a producer warp can copy them through a shared-memory ring without ever waiting on the
activations, while the consumer warps wait at each phase boundary for the whole grid (a grid barrier) and, once a
layer, for an attention-like latency. If the ring hides those waits, the stream runs at the copy rate throughout.

One persistent launch, one program a multiprocessor, streams a qwen3-1.7b-shaped sequence of matrix-vector phases
(28 layers of q|k|v, o-proj, gate/up, down-proj, each [rows, 2048] bf16, rows rounded up to whole boxes a program;
~2.9 GB) and multiplies every row by one x. Each config runs three ways:

  stream     no waits between phases: the ring's own streaming rate
  barriers   a grid barrier before every phase (the consumers of all programs finished the previous one)
  attention  barriers, plus DELAY_US of latency before each layer's o-proj (the attention's chain, ~5 us today)

    python scripts/ring_stream_probe.py [--configs 4/6 4/12 8/6/8 4/6/4/light ...] [--delay-us 5] [--json out.json]

A config is box rows / ring stages [/ consumer warps [/ light]]: a box of 4 rows is 16 KiB; `light` consumers
release each box unread (results zeros), so the consumers' own work cannot set the pace. Each figure: us for the
whole pass (median of timed repeats after a warm-up; a counter reset rides along), GB/s of weights, % of the read
bandwidth measured in the same run, and the result's error against torch's fp32 product (a wrong ring would show).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from inference.bench.ceiling import measure_bandwidth  # noqa: E402
from inference.bench.model_setup import cuda_missing  # noqa: E402
from inference.bench.timing import median_ms  # noqa: E402
from scripts.barrier_probe import _acquire, _relaxed  # noqa: E402  (the grid barrier's loads, GPU scope)

K = 2048
BOX_RUNS, RUN = 8, 256  # a box: BOX_R whole rows of 2048, each row 8 runs of 256
BOX_C, BK = gl.constexpr(BOX_RUNS), gl.constexpr(RUN)  # the same, for kernels
LAYERS = 28
# qwen3-1.7b's rows a layer at K = 2048 (the down-proj's [2048, 6144] counted as 6144 rows of 2048)
LAYER_ROWS = {"qkv": 4096, "o": 2048, "gate_up": 12288, "down": 6144}


@gluon.jit
def _now_ns(ptr):
    # ptr only gives the asm an operand; %globaltimer counts ns (in 32 ns or coarser steps)
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [ptr], dtype=gl.int64, is_pure=False,
                                     pack=1)  # fmt: skip


@gluon.jit
def _producer(w_desc, ring, full, empty, phase_boxes_ptr, phase_row0_ptr, phases):
    """One warp: every box of this program's share of every phase, in order, into the ring. It waits only for a
    free stage, never for the activations."""
    # warp_specialize turns constexpr arguments into tensors: the shapes come from the ring's own type
    STAGES: gl.constexpr = ring.shape[0]
    BOX_R: gl.constexpr = ring.shape[1]
    pid = gl.program_id(0)
    box = 0
    for p in range(phases):
        boxes = gl.load(phase_boxes_ptr + p)
        row0 = gl.load(phase_row0_ptr + p) + pid * boxes * BOX_R
        for b in range(boxes):
            stage = box % STAGES
            # a stage's first use needs no wait; later ones wait for the consumers' release of its last use
            mbarrier.wait(empty.index(stage), ((box // STAGES) & 1) ^ 1, pred=box >= STAGES)
            mbarrier.expect(full.index(stage), BOX_R * BOX_C * BK * 2)
            tma.async_copy_global_to_shared(
                w_desc, [row0 + b * BOX_R, 0, 0], full.index(stage), ring.index(stage)
            )
            box += 1


@gluon.jit
def _consumer(ring, full, empty, x_ptr, out_ptr, counter_ptr, phase_boxes_ptr, phase_row0_ptr, phase_delay_ptr,
              phases, barriers, light):  # fmt: skip
    """The default warps: for each phase, wait for the whole grid's previous phase (barriers) and the phase's
    delay, then each box as it lands: its rows times x, stored; the stage released to the producer. `light`: the
    boxes are released unread (a probe of whether the consumers' own work sets the pace; results are zeros)."""
    STAGES: gl.constexpr = ring.shape[0]
    BOX_R: gl.constexpr = ring.shape[1]
    # [BOX_R, BOX_C, BK] in registers, 16 contiguous bytes a thread, the warps along the rows: each sums whole
    # rows with shuffles alone (warps along a row's runs would meet in shared memory for every box's sums)
    box_layout: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 1, 32], [gl.num_warps(), 1, 1], [2, 1, 0])
    x_layout: gl.constexpr = gl.SliceLayout(0, box_layout)  # [BOX_C, BK]
    rows_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, box_layout))  # [BOX_R]
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    chunks = gl.arange(0, BOX_C, layout=gl.SliceLayout(1, x_layout))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, x_layout))
    x = gl.load(x_ptr + gl.expand_dims(chunks, 1) * BK + gl.expand_dims(cols, 0))  # [BOX_C, BK] fp32
    xb = gl.expand_dims(x, 0)
    box_rows = gl.arange(0, BOX_R, layout=rows_layout)
    box = 0
    for p in range(phases):
        if barriers and p > 0:
            target = p * programs
            seen = _relaxed(counter_ptr)
            while seen < target:
                seen = _relaxed(counter_ptr)
            seen = _acquire(counter_ptr)
        delay = gl.load(phase_delay_ptr + p)
        if delay > 0:  # an attention-like latency: the consumers wait, the producer goes on
            start = _now_ns(counter_ptr)
            now = _now_ns(counter_ptr)
            while now - start < delay:
                now = _now_ns(counter_ptr)
        boxes = gl.load(phase_boxes_ptr + p)
        row0 = gl.load(phase_row0_ptr + p) + pid * boxes * BOX_R
        for b in range(boxes):
            stage = box % STAGES
            mbarrier.wait(full.index(stage), (box // STAGES) & 1)
            if light:
                y = gl.zeros([BOX_R], gl.float32, layout=rows_layout)
            else:
                w = ring.index(stage).load(box_layout).to(gl.float32)  # [BOX_R, BOX_C, BK]
                y = gl.sum(gl.sum(w * xb, axis=2), axis=1)  # [BOX_R]
            gl.thread_barrier()  # every warp has read the stage before it is handed back
            mbarrier.arrive(empty.index(stage), count=1)
            gl.store(out_ptr + row0 + b * BOX_R + box_rows, y)
            box += 1
        if barriers:
            gl.thread_barrier()  # the phase's stores are issued before the program says it is done
            gl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _ring_stream_kernel(w_desc, x_ptr, out_ptr, counter_ptr, phase_boxes_ptr, phase_row0_ptr, phase_delay_ptr, light,
                        PHASES: gl.constexpr, STAGES: gl.constexpr, BARRIERS: gl.constexpr,
                        BOX_R: gl.constexpr):  # fmt: skip
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BOX_R, BOX_C, BK], w_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    consumer_args = (ring, full, empty, x_ptr, out_ptr, counter_ptr, phase_boxes_ptr, phase_row0_ptr,
                     phase_delay_ptr, PHASES, BARRIERS, light)  # fmt: skip
    producer_args = (w_desc, ring, full, empty, phase_boxes_ptr, phase_row0_ptr, PHASES)
    gl.warp_specialize(
        [(_consumer, consumer_args), (_producer, producer_args)],
        [1],
        [48],  # the producer holds a few counters and addresses
    )


def phase_plan(programs: int, delay_ns: int, box_rows: int) -> tuple[list[int], list[int], list[int], int]:
    """(boxes a program, first row, delay ns) of every phase, and the rows in all: each kind's rows rounded up to
    whole boxes for every program; the delay after each layer's q|k|v."""
    boxes, row0, delays, rows = [], [], [], 0
    for _ in range(LAYERS):
        for kind, kind_rows in LAYER_ROWS.items():
            per_program = -(-kind_rows // (programs * box_rows))
            boxes.append(per_program)
            row0.append(rows)
            delays.append(delay_ns if kind == "o" else 0)  # the o-proj waits for the attention
            rows += per_program * programs * box_rows
    return boxes, row0, delays, rows


def run_variant(weight, x, programs, plan, box_rows, stages, barriers, repeats, light=False, warps=4) -> dict:
    device = weight.device
    boxes, row0, delays, rows = plan
    to_i32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    phase_boxes, phase_row0 = to_i32(boxes), to_i32(row0)
    phase_delay = to_i32(delays)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)
    desc = TensorDescriptor.from_tensor(weight.view(rows, BOX_RUNS, RUN), [box_rows, BOX_RUNS, RUN], layout)
    out = torch.zeros(rows, dtype=torch.float32, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)

    def launch():
        counter.zero_()
        _ring_stream_kernel[(programs,)](desc, x, out, counter, phase_boxes, phase_row0, phase_delay, int(light),
                                         PHASES=len(boxes), STAGES=stages, BARRIERS=barriers, BOX_R=box_rows,
                                         num_warps=warps)  # fmt: skip

    launch()
    torch.cuda.synchronize()
    want = weight.float() @ x
    err = float("nan") if light else ((out - want).norm() / want.norm()).item()
    ms = median_ms(launch, repeats=repeats)
    return {"us": ms * 1e3, "gbs": weight.numel() * 2 / (ms * 1e-3) / 1e9, "rel_err": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["4/6", "4/12", "8/6", "16/3"],
                        help="box rows / ring stages [/ consumer warps [/ light]] (a box of 4 rows is 16 KiB; "
                             "light: the consumers release the boxes unread)")  # fmt: skip
    parser.add_argument("--delay-us", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if cuda_missing("ring_stream_probe"):
        sys.exit(2)
    device = torch.device("cuda")
    programs = torch.cuda.get_device_properties(device).multi_processor_count
    bandwidth = measure_bandwidth(device)["read_gbs"]
    results = {"programs": programs, "read_gbs": bandwidth, "variants": []}
    for config in args.configs:
        box_rows, stages, *rest = config.split("/")
        box_rows, stages = int(box_rows), int(stages)
        warps, light = (int(rest[0]) if rest else 4), "light" in rest
        boxes, row0, delays, rows = phase_plan(programs, int(args.delay_us * 1000), box_rows)
        gen = torch.Generator(device=device).manual_seed(0)
        weight = (torch.randn(rows, K, device=device, generator=gen) * 0.02).bfloat16()
        x = torch.randn(K, device=device, generator=gen)
        for name, barriers, delay in (
            ("stream", False, False),
            ("barriers", True, False),
            ("attention", True, True),
        ):
            plan = (boxes, row0, delays if delay else [0] * len(delays), rows)
            row = run_variant(
                weight, x, programs, plan, box_rows, stages, barriers, args.repeats, light, warps
            )
            row.update(variant=name, config=config, delay_us=args.delay_us if delay else 0.0,
                       mb=weight.numel() * 2 / 1e6, pct_of_read_bw=100 * row["gbs"] / bandwidth)  # fmt: skip
            results["variants"].append(row)
            print(f"{config:10s} {name:9s} delay {row['delay_us']:4.1f} us  {row['us']:8.1f} us  "
                  f"{row['gbs']:6.0f} GB/s ({row['pct_of_read_bw']:.1f}% of {bandwidth:,.0f})  "
                  f"err {row['rel_err']:.1e}", flush=True)  # fmt: skip
        del weight
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
