"""Compile every kernel of a model's decode step for sm_90 on this machine (no GPU needed) and report
registers, spills and 16-byte loads: the checks that cost no device time.

    python scripts/kernel_report.py laneformer-2b qwen3-1.7b llama-3.2-1b

The fast runner is built on `meta` tensors (no memory), one decode step is launched with every kernel
launch intercepted, and each distinct specialisation is compiled with the block sizes the launchers would
pick on an H200 (132 multiprocessors).
"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import kernels  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.bool: "i1", torch.int8: "i8"}  # fmt: skip


def intercepted_launches(preset: str) -> list[tuple[JITFunction, dict, dict, int]]:
    from inference.config import ModelConfig
    from inference.fast.runner import FastRunner
    from inference.fast.settings import Device, RunnerSettings
    from inference.model import Transformer
    from inference.presets import preset_config

    launches = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs, kwargs.get("num_warps", 4)))

    def fake_cluster_launch(kernel, clusters, size, args, kwargs, exchange_bytes=0):
        launches.append((kernel, args, kwargs, kwargs.get("num_warps", 4)))

    from kernels import decode_attention

    decode_attention.launch_clusters = fake_cluster_launch
    for module in ("rmsnorm_gemv", "lane_reduce_gemv", "decode_attention", "lm_head", "lm_head_screen", "final_norm",
                   "sample", "packed_mma_gemv"):  # fmt: skip
        mod = __import__(f"kernels.{module}", fromlist=["x"])
        mod.sm_count = lambda device: 132
        if hasattr(mod, "interpreted"):
            mod.interpreted = lambda: False
    kernels.sm_count = lambda device: 132
    JITFunction.run = fake_run
    cfg = ModelConfig.from_hf(preset_config(preset))
    model = Transformer(cfg, device="meta", dtype=torch.bfloat16)
    # an H200's settings for this model, the head screen on whatever its size
    h200 = RunnerSettings.resolve(cfg, Device(gpu=True, hopper=True, multiprocessors=132), torch.bfloat16)
    settings = dataclasses.replace(h200, head_screen=True)
    runner = FastRunner(model, min(4096, cfg.max_position_embeddings), settings=settings)
    runner.decode_step(greedy=True)
    runner.decode_step(greedy=False)  # the sampled step: its head, then kernels/sample.py
    runner.decode_step(greedy=False, screen=True)  # ... its head through the screen (lm_head_screen's logits)
    return launches


def compile_report(fn: JITFunction, args: tuple, kwargs: dict, num_warps: int) -> str:
    names = fn.arg_names
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    constexprs = {n for n, p in zip(names, fn.params, strict=True) if p.is_constexpr}
    signature, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = bound[name]
        if name in constexprs:
            signature[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + DTYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    compiled = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})  # fmt: skip
    ptx_path = Path("/tmp") / f"kernel_report_{fn.__name__}.ptx"
    ptx_path.write_text(compiled.asm["ptx"])
    ptx_path.with_suffix(".ttgir").write_text(compiled.asm["ttgir"])
    out = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(ptx_path), "-o", "/dev/null"],
                         capture_output=True, text=True).stderr  # fmt: skip
    regs = next(
        (line.split("Used ")[1].split(" registers")[0] for line in out.splitlines() if "registers" in line),
        "?",
    )
    spills = next((line.split(", ")[1] for line in out.splitlines() if "spill stores" in line), "?")
    blocks = {k: v for k, v in consts.items() if k.startswith(("BLOCK", "SPLITS", "K", "LANES"))}
    return f"{fn.__name__:28s} warps {num_warps} regs {regs:>3} {spills:24s} 16B loads {compiled.asm['ptx'].count('.v4.'):3d} {blocks}"


def main(presets: list[str]) -> None:
    for preset in presets:
        print(f"== {preset}")
        seen = set()
        for fn, args, kwargs, warps in intercepted_launches(preset):
            key = (fn.__name__, tuple(sorted((k, str(v)) for k, v in kwargs.items())),
                   tuple(str(a.dtype) if isinstance(a, torch.Tensor) else a for a in args))  # fmt: skip
            if key in seen:
                continue
            seen.add(key)
            print(compile_report(fn, args, kwargs, warps))


if __name__ == "__main__":
    main(sys.argv[1:] or ["laneformer-2b", "qwen3-1.7b", "llama-3.2-1b"])
