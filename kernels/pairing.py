"""Two kernels' programs in one launch: a latency-bound kernel (attention) beside a streaming one (a matrix-vector
product) of another, independent chain, so that the one's chain of dependent reads hides behind the other's
weights.

Why a launch and not two streams: on an H200 the block scheduler serves kernels nearly in launch order and every
matrix-vector kernel fills the GPU, so two streams' kernels run mostly one after the other, and two lane groups
in step run their attentions at the same time, the memory idle in both (kernels/NOTES.md, round 9). The programs
of one launch are resident together by construction.

A kernel that can be paired is written as a program body, `body(pid0, pid1, *args, *constexprs)` (the program's
grid coordinates as arguments, not tl.program_id), called by its own standalone kernel, which keeps its name in
traces. Its launcher builds a `Launch`; `Launch.run()` starts the standalone kernel, `run_paired(a, b)` one grid
of both: programs [0, a) run a's body, the next ones b's. The first kernel's programs are dispatched first
(lower ids). A launch's registers a thread are the larger of the two bodies', so a pair should join kernels of
similar register counts.

Both bodies keep their programmatic-dependent-launch wait: a paired launch waits for the whole previous launch,
as either kernel alone would.
"""

from dataclasses import dataclass, field
from math import prod

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from kernels import interpreted, pdl_kwargs
from kernels.cluster import launch_clusters


@dataclass
class Launch:
    """One kernel launch, described: `kernel[grid](*args, **constexprs, num_warps=...)`, or its programs run by
    `program` inside another launch (run_paired)."""

    kernel: JITFunction  # the standalone kernel: kernel(*args, *constexprs) calls program(pid0, pid1, ...)
    program: JITFunction
    grid: tuple[int, ...]  # (x,) or (x, y); with `cluster` > 1, (x,) with x a multiple of it
    args: tuple
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    use_pdl: bool = False
    cluster: int = 1  # programs a thread-block cluster along x (1: no clusters)
    maxnreg: int | None = None

    @property
    def programs(self) -> int:
        return prod(self.grid)

    def options(self) -> dict:
        return {"num_warps": self.num_warps, **pdl_kwargs(self.use_pdl),
                **({"maxnreg": self.maxnreg} if self.maxnreg else {})}  # fmt: skip

    def run(self) -> None:
        options = {**self.constexprs, **self.options()}
        if self.cluster > 1:
            launch_clusters(self.kernel, self.grid[0] // self.cluster, self.cluster, self.args, options)
        else:
            self.kernel[self.grid](*self.args, **options)

    def packed(self) -> tuple:
        """The body's arguments after (pid0, pid1) as one tuple: the runtime ones, then the constexprs (wrapped,
        so that the launch specialises on them as the standalone kernel does)."""
        names = self.program.arg_names[2 + len(self.args) :]
        if sorted(names) != sorted(self.constexprs):
            raise ValueError(f"{self.program.__name__}: constexprs {sorted(self.constexprs)} do not match the "
                             f"body's parameters {names}")  # fmt: skip
        return self.args + tuple(tl.constexpr(self.constexprs[name]) for name in names)


@triton.jit
def _paired_kernel(FIRST: tl.constexpr, first_args, first_x, first_programs, SECOND: tl.constexpr, second_args,
                   second_x, second_programs):  # fmt: skip
    pid = tl.program_id(0)
    if pid < first_programs:
        FIRST(pid % first_x, pid // first_x, *first_args)
    else:
        pid -= first_programs
        if pid < second_programs:  # a cluster's padding programs do nothing
            SECOND(pid % second_x, pid // second_x, *second_args)


def run_paired(first: Launch, second: Launch) -> None:
    """first's and second's programs in one launch (first's dispatched first). They must read nothing the other
    writes. Both need the same warps and PDL setting; only the first may use clusters (its programs start at id
    0, so its clusters stay whole; the second's programs are grouped too, which they do not notice)."""
    if first.num_warps != second.num_warps or first.use_pdl != second.use_pdl:
        raise ValueError(f"run_paired: {first.kernel.__name__} and {second.kernel.__name__} need the same warps "
                         f"and PDL setting, got {first.num_warps} / {second.num_warps} warps, PDL "
                         f"{first.use_pdl} / {second.use_pdl}")  # fmt: skip
    if second.cluster > 1:
        raise ValueError(f"run_paired: the second launch ({second.kernel.__name__}) cannot use clusters")
    size = first.cluster
    total = triton.cdiv(first.programs + second.programs, size) * size
    args = (first.program, first.packed(), first.grid[0], first.programs,
            second.program, second.packed(), second.grid[0], second.programs)  # fmt: skip
    options = {**first.options(), **second.options()}  # the same warps and PDL; either's register cap
    if interpreted():
        _paired_kernel_interpreted[(total,)](*_interpreter_args(args))
    elif size > 1:
        launch_clusters(_paired_kernel, total // size, size, args, options)
    else:
        _paired_kernel[(total,)](*args, **options)


@triton.jit
def _paired_kernel_interpreted(FIRST: tl.constexpr, first_args: tl.constexpr, first_x, first_programs,
                               SECOND: tl.constexpr, second_args: tl.constexpr, second_x, second_programs):  # fmt: skip
    """_paired_kernel under the interpreter (see _interpreter_args)."""
    pid = tl.program_id(0)
    if pid < first_programs:
        FIRST(pid % first_x, pid // first_x, *first_args)
    else:
        pid -= first_programs
        if pid < second_programs:
            SECOND(pid % second_x, pid // second_x, *second_args)


def _interpreter_args(args: tuple) -> tuple:
    """The interpreter converts every int inside a tuple argument into a tensor and hands constexpr objects on
    as they are, where the bodies need plain ints for their constexprs (arithmetic on a constexpr object and a
    tensor gives a constexpr-wrapped tensor). So the tuples go in as constexprs, their runtime values converted
    here as the interpreter converts a kernel's own arguments, their constexprs unwrapped."""
    from triton.runtime.interpreter import _implicit_cvt

    def convert(packed: tuple) -> tuple:
        return tuple(v.value if isinstance(v, tl.constexpr) else _implicit_cvt(v) for v in packed)

    first, first_args, *middle, second, second_args, second_x, second_programs = args
    return (first, convert(first_args), *middle, second, convert(second_args), second_x, second_programs)
