"""Kimi Delta Attention's rule on the CPU: the fused kernel (`NativeKda`) against the pure-torch one (`ReferenceKda`),
decode steps of 1 / 8 / 32 sequences and prefills of 64 / 256 / 1024 tokens, at Kimi's test shape (4 heads of 16)
and a realistic one (32 heads, Dk = Dv = 128). The two run alternately in one process, each call on the same pool
(its state advanced in place, as in serving); medians in milliseconds. The evidence for `kda_choice`'s native pick:

    python -m benchmarks.bench_kda [--state float32|bfloat16|int8] [--reps N] [--shapes 4x16,32x128]
        [--decode-rows 1,8,32] [--prefill-tokens 64,256,1024]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from worker_proc.kernels import native
from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.gated_delta import l2_normalize
from worker_proc.kernels.kda_ops import ReferenceKda

SHAPES = "4x16,32x128"  # heads x head dim
DECODE_ROWS = "1,8,32"
PREFILL_TOKENS = "64,256,1024"


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def _inputs(gen: torch.Generator, rows: int, heads: int, d: int) -> tuple[torch.Tensor, ...]:
    q = l2_normalize(torch.randn(rows, heads, d, generator=gen))
    k = l2_normalize(torch.randn(rows, heads, d, generator=gen))
    g = -torch.rand(rows, heads, d, generator=gen) * 0.1
    return q, k, torch.randn(rows, heads, d, generator=gen), g, torch.rand(rows, heads, generator=gen)


def _pool(gen: torch.Generator, slots: int, heads: int, d: int, state: str) -> codec.StatePool:
    states = torch.randn(slots + 1, heads, d, d, generator=gen) * 0.1
    states[0] = 0
    return codec.QuantizedPool(*codec.quantize(states)) if state == "int8" else states.to(codec.STORAGE[state])


def medians(calls: list[Callable[[], object]], reps: int) -> list[float]:
    """Each call's median time in ms, the calls taken in turn `reps` times."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(reps):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", default="float32", choices=codec.STATE_DTYPES)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--shapes", default=SHAPES, help="heads x head dim (Dk = Dv), comma-separated")
    parser.add_argument("--decode-rows", default=DECODE_ROWS, help="sequences of a decode step, comma-separated")
    parser.add_argument("--prefill-tokens", default=PREFILL_TOKENS, help="tokens of a prefill, comma-separated")
    args = parser.parse_args()
    shapes = [(int(h), int(d)) for h, d in (shape.split("x") for shape in args.shapes.split(","))]
    if not native.load():
        raise SystemExit(f"the fused CPU kernels cannot be built here: {native.load_error()}")
    from worker_proc.kernels.native.ops import NativeKda

    ref, fused, gen = ReferenceKda(), NativeKda(), torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, state {args.state}")
    for heads, d in shapes:
        for rows in _ints(args.decode_rows):
            pool, slots = _pool(gen, rows, heads, d, args.state), torch.arange(1, rows + 1)
            q, k, v, g, beta = _inputs(gen, rows, heads, d)
            call = (q, k, v, g, beta, d**-0.5, pool, slots)
            r, n = medians([partial(ref.step, *call), partial(fused.step, *call)], args.reps)
            print(f"decode  heads {heads:2d} d {d:3d} rows {rows:4d}: reference {r:9.3f} native {n:8.3f} ms")
        for tokens in _ints(args.prefill_tokens):
            pool, spans = _pool(gen, 1, heads, d, args.state), ((tokens, 1),)
            q, k, v, g, beta = _inputs(gen, tokens, heads, d)
            call = (q, k, v, g, beta, d**-0.5, pool, spans)
            r, n = medians([partial(ref.prefill_many, *call), partial(fused.prefill_many, *call)], args.reps)
            print(f"prefill heads {heads:2d} d {d:3d} rows {tokens:4d}: reference {r:9.3f} native {n:8.3f} ms")


if __name__ == "__main__":
    main()
