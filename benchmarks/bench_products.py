"""Matrix products alone on the CPU: every method the execution plan may time for a weight shape and storage,
at several row counts, each product reading its weight from memory.

    python benchmarks/bench_products.py [--shapes 4096x768,768x2048,100352x768] [--storage int8]
        [--dtype bfloat16] [--rows 1,8,32,128] [--threads 2] [--stream-mb 300] [--runs 5] [--methods A,B]

A shape gets as many copies of its weight (random, quantized to `--storage` where that is a quantized
format) as fill `--stream-mb`, more than a CPU's last-level cache, and one timed round multiplies the same
input by each copy in turn: what a decode step, which reads every weight once, sees. Per method and row
count the table shows the fastest of `--runs` rounds after an untimed one (us per product) and the weight
bytes it read per second. The methods are those of `THROUGHPUT_KERNELS` that `supports` such a site
(worker_proc.linear.kernels; `--methods` keeps the named ones), their copies (a packed or tiled copy,
an int8 copy of a quantized weight) made as the plan's bind makes them. No server, no model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker_proc.host.numerics import flush_denormals
from worker_proc.linear.formats import THROUGHPUT_KERNELS
from worker_proc.linear.kernels import COPIES, GemmKernel
from worker_proc.linear.site import GemmSite
from worker_proc.loading.quantize import quantize_weight

STORAGES = ("dense", "int8", "int4", "fp8")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"OUTxIN,..." -> [(out, in), ...]."""
    shapes = []
    for part in text.split(","):
        out, sep, inp = part.strip().partition("x")
        if not sep or not out.isdigit() or not inp.isdigit() or int(out) < 1 or int(inp) < 1:
            raise ValueError(f"a shape is OUTxIN, e.g. 4096x768, not {part!r}")
        shapes.append((int(out), int(inp)))
    return shapes


def _copy(shape: tuple[int, int], dtype: torch.dtype, storage: str,
          gen: torch.Generator) -> tuple[GemmSite, torch.Tensor]:
    weight = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    site = GemmSite(shape[0], shape[1], dtype, packable=True)
    if storage != "dense":
        site.quantize(quantize_weight(weight, storage))
        weight = weight.new_empty(0)
    return site, weight


def _stored(method: GemmKernel, site: GemmSite, weight: torch.Tensor) -> object:
    """What the method reads besides the dense weight, made as the plan's bind makes it."""
    if site.quantized is not None:
        return site.quantized.with_copy(method.quantized_copy) if method.quantized_copy else site.quantized
    return COPIES[method.storage](weight) if method.storage in COPIES else None


def time_method(method: GemmKernel, copies: list[tuple[GemmSite, torch.Tensor]], rows: int, runs: int) -> float:
    """Seconds per product: the fastest of `runs` rounds over every copy, after an untimed round."""
    stored = [(_stored(method, site, w), w) for site, w in copies]
    x = torch.randn(rows, copies[0][0].shape[1], generator=torch.Generator().manual_seed(rows)).to(copies[0][0].dtype)
    best = float("inf")
    for rnd in range(runs + 1):
        t0 = time.perf_counter()
        for s, w in stored:
            method.apply(x, w, s, None)
        if rnd:
            best = min(best, (time.perf_counter() - t0) / len(stored))
    return best


def run(shapes: list[tuple[int, int]], storage: str, dtype: torch.dtype, rows: list[int], stream_bytes: int,
        runs: int, only: frozenset[str] = frozenset()) -> list[tuple[str, str, int, float, float]]:
    """(shape label, method, rows, us per product, GB/s of weight read) for every supported method."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for shape in shapes:
        first = _copy(shape, dtype, storage, gen)
        per_copy = first[0].weight_bytes(first[1])
        copies = [first] + [_copy(shape, dtype, storage, gen) for _ in range(max(1, stream_bytes // per_copy) - 1)]
        methods = [m for m in THROUGHPUT_KERNELS if m.supports(first[0], torch.device("cpu"))
                   and (not only or m.name in only)]
        for r in rows:
            for m in methods:
                if m.max_rows and r > m.max_rows:
                    continue
                seconds = time_method(m, copies, r, runs)
                out.append((f"{shape[0]}x{shape[1]}", m.name, r, seconds * 1e6, per_copy / seconds / 1e9))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4096x768,768x2048,100352x768", help="OUTxIN shapes, comma-separated")
    ap.add_argument("--storage", default="int8", choices=STORAGES, help="dense or a quantized format")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="activations, dense weights")
    ap.add_argument("--rows", default="1,8,32,128", help="input row counts, comma-separated")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--stream-mb", type=int, default=300, help="weight bytes one round reads per shape")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--methods", default="", help="only these methods, comma-separated (default: every one)")
    args = ap.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    if any(r < 1 for r in rows) or args.runs < 1 or args.stream_mb < 1 or args.threads < 1:
        ap.error("--rows, --runs, --stream-mb and --threads take positive numbers")
    only = frozenset(m for m in args.methods.split(",") if m)
    unknown = sorted(only - {m.name for m in THROUGHPUT_KERNELS})
    if unknown:
        ap.error(f"no method named {', '.join(unknown)} (known: {', '.join(m.name for m in THROUGHPUT_KERNELS)})")
    flush_denormals()
    torch.set_num_threads(args.threads)
    table = run(shapes, args.storage, getattr(torch, args.dtype), rows, args.stream_mb * 2**20, args.runs, only)
    print(f"{args.storage} weights, {args.dtype} activations, {args.threads} threads, fastest of {args.runs} rounds")
    print("shape | method | rows | us per product | weight GB/s")
    for label, name, r, us, gbs in table:
        print(f"{label} | {name} | {r} | {us:.4g} | {gbs:.4g}")


if __name__ == "__main__":
    main()
