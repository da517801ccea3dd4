"""Compile every Triton kernel for a CUDA GPU (default sm_90, H100/H200) on a machine without one.

Run as `python -m tests.kernels.cuda_compile [--arch 90]`
WITHOUT TRITON_INTERPRET: the interpreter accepts programs the compiler rejects, so this catches
what the CPU tests cannot (type errors in compiled mode, unsupported ops, dot shapes, too much shared
memory). Launches are intercepted (nothing runs): `TritonOps` is called on CPU tensors of Granite
4.0-H shapes, each launch's argument types and constexprs become a signature, and
`triton.compile` takes it through to a cubin with the ptxas bundled in the triton wheel.
Exit status 0 when every kernel compiled and fits the shared memory of the target.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32"}


def _type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value)}")


def capture_launches(dtype: torch.dtype) -> list[tuple[object, tuple, dict]]:
    """Call every TritonOps method on CPU tensors with launches recorded instead of run."""
    from triton.runtime.jit import JITFunction

    from worker_proc.kernels.interface import SsdParams
    from worker_proc.kernels.triton.attention import attn_decode
    from worker_proc.kernels.triton.ops import TritonOps

    launches: list[tuple[object, tuple, dict]] = []
    JITFunction.__getitem__ = lambda self, grid: lambda *a, **k: launches.append((self, a, k))  # type: ignore
    ops, t, h, p, n, cd = TritonOps(), 300, 48, 64, 128, 3328
    x, w = torch.zeros(t, cd, dtype=dtype), torch.zeros(cd, 4, dtype=dtype)
    conv = torch.zeros(4, cd, 3, dtype=dtype)
    ops.conv_prefill(x, conv, 1, w, w[:, 0])
    ops.conv_decode(x[:3], conv, torch.tensor([1, 2, 3]), w, None)
    xs, dt, bc = torch.zeros(t, h, p, dtype=dtype), torch.zeros(t, h, dtype=dtype), torch.zeros(t, 1, n, dtype=dtype)
    a, d, ssm = torch.zeros(h), torch.zeros(h, dtype=dtype), torch.zeros(4, h, p, n)
    params = SsdParams(a, d, d, (0.0, float("inf")), 256)
    ops.ssd_prefill(xs, dt, bc, bc, params, ssm, 1)
    ops.ssd_decode(xs[:3], dt[:3], bc[:3], bc[:3], params, ssm, torch.tensor([1, 2, 3]))
    q, kv = torch.zeros(t, 12, 128, dtype=dtype), torch.zeros(1000, 4, 128, dtype=dtype)
    ops.attn_prefill(q, kv, kv, torch.zeros(t + 10, dtype=torch.int64), 10, 0.1)
    attn_decode(q[:2], kv, kv, torch.zeros(2, 900, dtype=torch.int64), torch.tensor([900, 5]), 0.1)  # split-K
    ops.attn_decode(q[:256], kv, kv, torch.zeros(256, 90, dtype=torch.int64), torch.zeros(256).long(), 0.1)
    return launches


def compile_launches(launches: list[tuple[object, tuple, dict]], arch: int) -> list[str]:
    """Compile each distinct launch; returns one problem line per failure (empty when all is well)."""
    import triton
    from triton.backends.compiler import GPUTarget

    problems, seen = [], set()
    for fn, args, kwargs in launches:
        options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        sig = {name: _type(v) for name, v in zip(fn.arg_names, args, strict=False)}
        sig.update({name: "constexpr" for name in kwargs})
        key = (fn.__name__, tuple(sig.items()), tuple(sorted(kwargs.items())), tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        src = triton.compiler.ASTSource(fn, sig, dict(kwargs))
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        except Exception as exc:  # noqa: BLE001 - report every kernel, not just the first failure
            problems.append(f"{fn.__name__} {kwargs}: {type(exc).__name__}: {exc}")
            continue
        shared = kernel.metadata.shared
        if shared > SHARED_LIMIT.get(arch, 99 * 1024):
            problems.append(f"{fn.__name__} {kwargs}: {shared} B shared memory exceeds sm_{arch}")
        print(f"sm_{arch} {fn.__name__:28s} shared {shared:7d} B  {kwargs} {options}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compile the Triton kernels for a CUDA target, no GPU needed")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("cuda_compile: unset TRITON_INTERPRET (kernels must be compiled, not interpreted)")
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    problems = compile_launches(capture_launches(dtype), args.arch)
    for line in problems:
        print("FAILED", line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
