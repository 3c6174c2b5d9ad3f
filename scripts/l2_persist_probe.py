"""Does a slice of the head's weights kept in L2 across decode steps (an access-policy window with the
persisting property on the kernels of the step's graph) make a step faster? (GPU only)

    python scripts/l2_persist_probe.py --model llama-3.2-1b --set-aside 20 \
        --variant first:0 --variant first:max --variant normal:max [--rounds 3] [--json out.json]

Every token reads every weight once, so no weight is in L2 from one step to the next (60 MiB of L2 against
2.5-4.5 GB). Hopper sets aside part of its L2 (--set-aside MiB, rounded by the driver) for lines marked
persisting; a window over the head's first N MiB marks them, and the next step could find them there. A
variant is POLICY:MIB: the head's weight loads evict_first (the kernels' own: "first"), normal or evict_last,
and the window's MiB (0: none; max: the set-aside). Variants are timed in turns in one process (the set-aside
emptied before each), then the head alone, 16 calls back to back in one graph; tok/s is the median over rounds
of bench.time_fast's median.
"""

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from inference.bench import build_model, cuda_missing, measure_bandwidth, step_bytes, time_fast  # noqa: E402
from inference.fast.runner import FastRunner  # noqa: E402
from kernels.lm_head import lm_head  # noqa: E402

MIB = 2**20
# CUDA driver API enums (cuda.h)
LIMIT_PERSISTING_L2 = 0x06  # CU_LIMIT_PERSISTING_L2_CACHE_SIZE
ATTR_L2_SIZE, ATTR_MAX_PERSISTING, ATTR_MAX_WINDOW = 38, 108, 109  # CU_DEVICE_ATTRIBUTE_*
LAUNCH_ATTR_ACCESS_POLICY_WINDOW = 1  # CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW
NODE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
ACCESS_NORMAL, ACCESS_STREAMING, ACCESS_PERSISTING = 0, 1, 2  # CUaccessProperty


class AccessPolicyWindow(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hit_ratio", ctypes.c_float),
                ("hit_prop", ctypes.c_int), ("miss_prop", ctypes.c_int)]  # fmt: skip


class LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes
    _fields_ = [("window", AccessPolicyWindow), ("pad", ctypes.c_char * 64)]


class Driver:
    """The few driver calls this needs, through ctypes (torch's runtime context is the current one)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def check(self, name: str, *args) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name} failed with CUresult {code}")

    def device_attribute(self, attribute: int, device: int = 0) -> int:
        value = ctypes.c_int()
        self.check("cuDeviceGetAttribute", ctypes.byref(value), attribute, device)
        return value.value

    def set_persisting_limit(self, nbytes: int) -> int:
        self.check("cuCtxSetLimit", LIMIT_PERSISTING_L2, ctypes.c_size_t(nbytes))
        value = ctypes.c_size_t()
        self.check("cuCtxGetLimit", ctypes.byref(value), LIMIT_PERSISTING_L2)
        return value.value

    def reset_persisting(self) -> None:
        self.check("cuCtxResetPersistingL2Cache")

    def set_window(self, graph: int, base: int, nbytes: int, hit_ratio: float) -> int:
        """The window on every kernel node of a (not yet instantiated) graph; returns how many nodes."""
        count = ctypes.c_size_t()
        self.check("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(count))
        nodes = (ctypes.c_void_p * count.value)()
        self.check("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(count))
        value = LaunchAttributeValue()
        value.window = AccessPolicyWindow(base, nbytes, hit_ratio, ACCESS_PERSISTING, ACCESS_STREAMING)
        kernels = 0
        for node in nodes:
            kind = ctypes.c_int()
            self.check("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
            if kind.value == NODE_KERNEL:
                self.check("cuGraphKernelNodeSetAttribute", ctypes.c_void_p(node), LAUNCH_ATTR_ACCESS_POLICY_WINDOW,
                           ctypes.byref(value))  # fmt: skip
                kernels += 1
        return kernels


POLICIES = {"first": "evict_first", "normal": "", "last": "evict_last"}  # the head's weight loads


def parse_variant(spec: str, set_aside: int) -> tuple[str, int]:
    """'normal:max' -> ('', the set-aside in bytes); 'first:0' -> ('evict_first', 0): no window."""
    policy, _, mib = spec.partition(":")
    if policy not in POLICIES:
        raise SystemExit(f"--variant {spec}: the policy is one of {', '.join(POLICIES)}")
    return POLICIES[policy], set_aside if mib == "max" else int(mib or 0) * MIB


def captured(run, driver: Driver, base: int, nbytes: int):
    """run() captured as a graph, with the window over [base, base + nbytes) on each kernel node (none at 0)."""
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        run()
    kernels = driver.set_window(graph.raw_cuda_graph(), base, nbytes, 1.0) if nbytes else 0
    graph.instantiate()
    return graph, kernels


def step_graph(runner: FastRunner, driver: Driver, policy: str, nbytes: int):
    """The runner's greedy decode step with the head's loads under `policy`, token and position kept."""
    saved = [t.clone() for t in (runner.token, runner.pos, runner.out_tokens, runner.seen)]
    runner.head_blocks["evict"] = policy
    try:
        graph, kernels = captured(
            lambda: runner.decode_step(True), driver, runner.head_weight.data_ptr(), nbytes
        )
    finally:
        del runner.head_blocks["evict"]
    for t, s in zip((runner.token, runner.pos, runner.out_tokens, runner.seen), saved, strict=True):
        t.copy_(s)
    return graph, kernels


def head_alone_us(runner: FastRunner, driver: Driver, policy: str, nbytes: int, calls: int = 16) -> float:
    """us a call of the head alone (no sampling), `calls` back to back in one graph: nothing of its 0.2-0.6 GB
    stays in L2 from one call to the next but what the window keeps."""
    one_lane = runner.cfg.num_lanes == 1
    x = runner.x[0] if one_lane else runner.head_in
    norm = runner.final_norm_weight[0] if one_lane else None
    blocks = {**runner.head_blocks, "evict": policy}

    def run() -> None:
        for _ in range(calls):
            lm_head(x, runner.head_weight, runner.logits, runner.head_scratch, norm_weight=norm, greedy=False,
                    **blocks)  # fmt: skip

    run()
    graph, _ = captured(run, driver, runner.head_weight.data_ptr(), nbytes)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        driver.reset_persisting()
        graph.replay()  # fills what the window keeps
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=[])
    parser.add_argument("--variant", action="append", default=[],
                        help="POLICY:MIB, the head's load policy (first, normal, last) and its window (0: none; "
                             "max: the set-aside)")  # fmt: skip
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set-aside", default="max", help="the persisting set-aside, MiB ('max': the most)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if cuda_missing("l2_persist_probe"):
        return 2
    device = torch.device("cuda")
    driver = Driver()
    bandwidth = measure_bandwidth(device)
    torch.cuda.empty_cache()
    l2, max_persisting = driver.device_attribute(ATTR_L2_SIZE), driver.device_attribute(ATTR_MAX_PERSISTING)
    max_window = driver.device_attribute(ATTR_MAX_WINDOW)
    wanted = max_persisting if args.set_aside == "max" else int(args.set_aside) * MIB
    set_aside = driver.set_persisting_limit(wanted) if wanted else 0
    print(f"L2 {l2 / MIB:.1f} MiB, persisting at most {max_persisting / MIB:.1f} MiB (set aside "
          f"{set_aside / MIB:.1f}), window at most {max_window / MIB:.1f} MiB; read {bandwidth['read_gbs']:,.0f} GB/s")  # fmt: skip
    report = {"l2": l2, "max_persisting": max_persisting, "set_aside": set_aside, "max_window": max_window,
              "bandwidth": bandwidth, "models": {}}  # fmt: skip
    specs = args.variant or ["first:0", "first:max", "normal:0", "normal:max", "last:0"]
    for name in args.model or ["llama-3.2-1b"]:
        torch.cuda.empty_cache()
        model = build_model(name, device, torch.bfloat16)
        runner = FastRunner(model, args.prompt_len + args.new_tokens + 1)
        head_bytes = runner.head_weight.numel() * runner.head_weight.element_size()
        ceiling = bandwidth["read_gbs"] * 1e9 / step_bytes(model, args.prompt_len + args.new_tokens // 2)
        variants = {}
        for spec in specs:
            policy, nbytes = parse_variant(spec, set_aside)
            nbytes = min(nbytes, head_bytes, max_window)
            variants[spec] = (*step_graph(runner, driver, policy, nbytes), policy, nbytes)
        prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,),
                               generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
        tok_s: dict[str, list[float]] = {v: [] for v in variants}
        tokens: dict[str, list[int]] = {}
        default_graph = runner.graphs[True, 1]
        for _ in range(args.rounds):
            for v, (graph, *_) in variants.items():
                driver.reset_persisting()
                runner.graphs[True, 1] = graph  # what time_fast replays
                tok_s[v].append(time_fast(runner, prompt, args.new_tokens, args.runs)["tok_s"])
                tokens[v] = runner.out_tokens[args.prompt_len : args.prompt_len + args.new_tokens].tolist()
        runner.graphs[True, 1] = default_graph
        first = specs[0]
        print(f"{name}: ceiling {ceiling:,.0f} tok/s; head {head_bytes / MIB:,.0f} MiB")
        rows = {}
        for v, t in tok_s.items():
            med = statistics.median(t)
            _, kernels, policy, nbytes = variants[v]
            head_us = head_alone_us(runner, driver, policy, nbytes)
            same = tokens[v] == tokens[first]
            rows[v] = {"tok_s": med, "rounds": t, "kernel_nodes": kernels, "window_bytes": nbytes,
                       "head_alone_us": head_us, "same_tokens": same}  # fmt: skip
            print(f"  {v:<12} {med:>8,.1f} tok/s {1e6 / med:7.1f} us  {100 * med / ceiling:5.1f}%  "
                  f"({', '.join(f'{x:,.0f}' for x in t)}) head alone {head_us:6.1f} us "
                  f"{'same tokens' if same else 'OTHER TOKENS'}")  # fmt: skip
        report["models"][name] = {"ceiling_tok_s": ceiling, "rows": rows}
        del runner, model, variants
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
