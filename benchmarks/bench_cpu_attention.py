"""The fused CPU attention kernels (`NativeOps`) against torch's CPU flash attention (`FastOps`), in one process.

    python benchmarks/bench_cpu_attention.py [--dtype bfloat16] [--contexts 0,4096,16384] [--chunk 512]
        [--heads 12] [--kv-heads 4] [--head-dim 64] [--threads 2] [--runs 7]

Prefill: one chunk of --chunk queries after each context length (causal over the chunk, the context in
full), the model's slots one ascending run as a fresh server lays them out. Decode: one query per head
over each context (plus the chunk). Four layers' pools are cycled so that a call reads its context from
memory, as a step does. Medians of --runs calls after one warm-up; GFLOP/s counts the causal products.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from worker_proc.kernels import FastOps, native

LAYERS = 4


def _median_s(fn: Callable[[int], object], runs: int) -> float:
    fn(0)
    times = []
    for i in range(runs):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rows(args: argparse.Namespace, ctx: int, dt: torch.dtype, fused: FastOps, flash: FastOps) -> list[str]:
    """The prefill and decode rows of one context length."""
    n = ctx + args.chunk
    pools = [[torch.randn(n + 1, args.kv_heads, args.head_dim).to(dt) for _ in range(2)] for _ in range(LAYERS)]
    idx = torch.arange(1, n + 1)
    q = torch.randn(args.chunk, args.heads, args.head_dim).to(dt)
    rows = []
    t_flash = _median_s(lambda i: flash.attn_prefill(q, *pools[i % LAYERS], idx, ctx, 0.125), args.runs)
    t_fused = _median_s(lambda i: fused.attn_prefill(q, *pools[i % LAYERS], idx, ctx, 0.125), args.runs)
    flops = 4 * args.heads * args.head_dim * args.chunk * (ctx + args.chunk / 2)
    rows.append(f"| prefill {args.chunk} after {ctx} | {t_flash * 1e3:.2f} | {t_fused * 1e3:.2f} | "
                f"{t_flash / t_fused:.2f}x | {flops / t_fused / 1e9:.0f} |")  # fmt: skip
    q1, lengths = q[:1].contiguous(), torch.tensor([n])
    t_flash = _median_s(lambda i: flash.attn_decode(q1, *pools[i % LAYERS], idx[None], lengths, 0.125), args.runs)
    t_fused = _median_s(lambda i: fused.attn_decode(q1, *pools[i % LAYERS], idx[None], lengths, 0.125), args.runs)
    flops = 4 * args.heads * args.head_dim * n
    rows.append(f"| decode over {n} | {t_flash * 1e3:.3f} | {t_fused * 1e3:.3f} | {t_flash / t_fused:.2f}x | "
                f"{flops / t_fused / 1e9:.0f} |")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--contexts", default="0,4096,16384")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args(argv)
    if not native.load():
        raise SystemExit(f"the fused CPU kernels cannot be built here: {native.load_error()}")
    from worker_proc.kernels.native.ops import NativeOps

    torch.set_num_threads(args.threads)
    dt = getattr(torch, args.dtype)
    fused, flash = NativeOps(), FastOps()
    print(f"{args.dtype}, {args.heads} query / {args.kv_heads} KV heads of {args.head_dim}, {args.threads} threads")
    print("| case | torch flash ms | fused ms | speed-up | fused GFLOP/s |")
    print("|---|---|---|---|---|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        for row in _rows(args, ctx, dt, fused, flash):
            print(row)

if __name__ == "__main__":
    main()
