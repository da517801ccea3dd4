"""Benchmark cases of bench_kernels.py: inputs, implementations and minimum bytes moved per kernel call.

Every case builds its tensors once on the device; each
implementation is a zero-argument callable (pools are updated in place, as in serving). `check_ref`
and `checks[impl]` run on fresh pool copies and return comparable outputs (the kernel's output and
the pool rows it advanced). Third-party kernels (mamba_ssm, causal_conv1d) are added only when
importable; their call conventions vary by version, so bench_kernels reports their errors per case.
As a script it lists the cases of a shape (built on the device, one at a time) without timing any:

    python -m benchmarks.bench_kernels_cases [--preset cpu-tiny|micro|tiny] [--quick] [--device cpu]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from worker_proc.kernels import ReferenceOps
from worker_proc.kernels.interface import SsdParams
from worker_proc.kernels.triton.attention import attn_prefill_varlen
from worker_proc.kernels.triton.chunk_plan import plan_chunks
from worker_proc.kernels.triton.conv import conv_prefill_varlen
from worker_proc.kernels.triton.ops import TritonOps
from worker_proc.kernels.triton.ssd import ssd_scan_varlen

NO_LIMIT = (0.0, float("inf"))
# the reference is timed in its batched form (batch_invariant=False: one padded decode attention)
REF_ATTN_MAX_BYTES = 8 * 2**30  # the reference materializes [heads, L, T] fp32 scores; skip it beyond this


@dataclass(frozen=True)
class ModelShape:
    """Per-layer dimensions of one model (one tensor-parallel rank)."""

    d_model: int
    mamba_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    chunk: int
    attn_heads: int
    kv_heads: int
    attn_head_dim: int

    @property
    def conv_dim(self) -> int:
        return self.mamba_heads * self.head_dim + 2 * self.n_groups * self.d_state


PRESETS = {
    # ibm-granite/granite-4.0-h-micro: d_model 2048, 64 Mamba heads, 32 q / 8 kv heads of 64
    "micro": ModelShape(2048, 64, 64, 128, 1, 4, 256, 32, 8, 64),
    # ibm-granite/granite-4.0-h-tiny: d_model 1536, 48 Mamba heads, 12 q / 4 kv heads of 128
    "tiny": ModelShape(1536, 48, 64, 128, 1, 4, 256, 12, 4, 128),
}
CPU_TINY = ModelShape(64, 4, 16, 16, 1, 4, 32, 4, 2, 16)


@dataclass
class Case:
    name: str
    bytes: int
    impls: dict[str, Callable[[], object]]
    check_ref: Callable[[], object] | None  # None: the reference is too large to run for this shape
    checks: dict[str, Callable[[], object]] = field(default_factory=dict)


def _optional(module: str, name: str) -> Callable[..., object] | None:
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - not installed, or installed without its CUDA extension
        return None


def _cu(lengths: list[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _with_pool(pool: torch.Tensor, slots: torch.Tensor, fn: Callable[[torch.Tensor], object]) -> Callable[[], object]:
    """A check: run fn on a copy of the pool, return (its output, the advanced pool rows)."""

    def check() -> object:
        copy = pool.clone()
        return fn(copy), copy[slots.long()]

    return check


def conv_decode_case(s: ModelShape, batch: int, dev: torch.device, dt: torch.dtype) -> Case:
    cd, k = s.conv_dim, s.d_conv
    x = torch.randn(batch, cd, device=dev, dtype=dt)
    pool = torch.randn(batch + 1, cd, k - 1, device=dev, dtype=dt)
    w, b = torch.randn(cd, k, device=dev, dtype=dt) * 0.3, torch.randn(cd, device=dev, dtype=dt)
    slots = torch.randperm(batch, device=dev) + 1
    e = x.element_size()
    tri, ref = TritonOps(), ReferenceOps(batch_invariant=False)
    impls = {
        "triton": lambda: tri.conv_decode(x, pool, slots, w, b),
        "reference": lambda: ref.conv_decode(x, pool, slots, w, b),
    }
    case = Case(
        f"conv_decode B={batch}",
        e * (2 * batch * cd + 2 * batch * cd * (k - 1) + cd * (k + 1)),
        impls,
        _with_pool(pool, slots, lambda p: ref.conv_decode(x, p, slots, w, b)),
        {"triton": _with_pool(pool, slots, lambda p: tri.conv_decode(x, p, slots, w, b))},
    )
    upd = _optional("causal_conv1d", "causal_conv1d_update")
    if upd is not None:
        idx = slots.int()
        case.impls["causal_conv1d"] = lambda: upd(x, pool, w, b, activation="silu", conv_state_indices=idx)
    return case


def conv_prefill_case(s: ModelShape, lengths: list[int], dev: torch.device, dt: torch.dtype) -> Case:
    cd, k, total = s.conv_dim, s.d_conv, sum(lengths)
    x = torch.randn(total, cd, device=dev, dtype=dt)
    pool = torch.randn(len(lengths) + 1, cd, k - 1, device=dev, dtype=dt)
    w, b = torch.randn(cd, k, device=dev, dtype=dt) * 0.3, torch.randn(cd, device=dev, dtype=dt)
    slots = torch.arange(1, len(lengths) + 1, device=dev)
    cu, cu_host = _cu(lengths, dev), _cu(lengths, torch.device("cpu")).tolist()
    ref = ReferenceOps(batch_invariant=False)

    def tri(p: torch.Tensor = pool) -> torch.Tensor:
        return conv_prefill_varlen(x, cu, max(lengths), p, slots, w, b)

    def reference(p: torch.Tensor = pool) -> torch.Tensor:
        return torch.cat(
            [ref.conv_prefill(x[cu_host[r] : cu_host[r + 1]], p, r + 1, w, b) for r in range(len(lengths))]
        )

    e = x.element_size()
    case = Case(
        f"conv_prefill L={'+'.join(map(str, lengths))}",
        e * (2 * total * cd + 2 * len(lengths) * cd * (k - 1) + cd * (k + 1)),
        {"triton": tri, "reference": reference},
        _with_pool(pool, slots, reference),
        {"triton": _with_pool(pool, slots, tri)},
    )
    fn = _optional("causal_conv1d", "causal_conv1d_fn")
    if fn is not None and len(lengths) == 1:
        xt = x.t()[None]  # (1, Cd, L), channels contiguous as the extension wants with initial states
        init = pool[1].t().contiguous().t()[None]
        case.impls["causal_conv1d"] = lambda: fn(
            xt, w, b, initial_states=init, return_final_states=True, activation="silu"
        )
    return case


def _ssd_inputs(s: ModelShape, rows: int, dev: torch.device, dt: torch.dtype) -> dict[str, torch.Tensor]:
    h, p, g, n = s.mamba_heads, s.head_dim, s.n_groups, s.d_state
    return dict(
        x=torch.randn(rows, h, p, device=dev, dtype=dt),
        dt=torch.randn(rows, h, device=dev, dtype=dt) - 2.0,
        a=-torch.rand(h, device=dev) - 0.5,
        b=torch.randn(rows, g, n, device=dev, dtype=dt) * 0.3,
        c=torch.randn(rows, g, n, device=dev, dtype=dt) * 0.3,
        d=torch.randn(h, device=dev, dtype=dt),
        dt_bias=torch.randn(h, device=dev, dtype=dt) * 0.1,
    )


def ssd_decode_case(s: ModelShape, batch: int, dev: torch.device, dt: torch.dtype) -> Case:
    t = _ssd_inputs(s, batch, dev, dt)
    h, p, n = s.mamba_heads, s.head_dim, s.d_state
    pool = torch.randn(batch + 1, h, p, n, device=dev) * 0.1
    slots = torch.randperm(batch, device=dev) + 1
    tri, ref = TritonOps(), ReferenceOps(batch_invariant=False)
    args = (t["x"], t["dt"], t["b"], t["c"], SsdParams(t["a"], t["d"], t["dt_bias"], NO_LIMIT, s.chunk))
    e = t["x"].element_size()
    case = Case(
        f"ssd_decode B={batch}",
        batch * (2 * h * p * n * 4 + h * p * (e + 4) + 2 * s.n_groups * n * e + h * e),
        {"triton": lambda: tri.ssd_decode(*args, pool, slots), "reference": lambda: ref.ssd_decode(*args, pool, slots)},
        _with_pool(pool, slots, lambda q: ref.ssd_decode(*args, q, slots)),
        {"triton": _with_pool(pool, slots, lambda q: tri.ssd_decode(*args, q, slots))},
    )
    upd = _optional("mamba_ssm.ops.triton.selective_state_update", "selective_state_update")
    if upd is not None:
        dt_e = t["dt"][..., None].expand(-1, -1, p)
        a_e = t["a"][:, None, None].expand(h, p, n)
        d_e, bias_e = t["d"][:, None].expand(h, p), t["dt_bias"][:, None].expand(h, p)
        case.impls["mamba_ssm"] = lambda: upd(
            pool, t["x"], dt_e, a_e, t["b"], t["c"], D=d_e, dt_bias=bias_e, dt_softplus=True, state_batch_indices=slots
        )
    return case


def ssd_prefill_case(s: ModelShape, lengths: list[int], dev: torch.device, dt: torch.dtype) -> Case:
    total = sum(lengths)
    t = _ssd_inputs(s, total, dev, dt)
    h, p, n = s.mamba_heads, s.head_dim, s.d_state
    pool = torch.randn(len(lengths) + 1, h, p, n, device=dev) * 0.1
    slots = torch.arange(1, len(lengths) + 1, device=dev)
    plan = plan_chunks(lengths, s.chunk)
    cu = _cu(lengths, torch.device("cpu")).tolist()
    ref = ReferenceOps(batch_invariant=False)

    def tri(q: torch.Tensor = pool) -> torch.Tensor:
        return ssd_scan_varlen(**t, dt_limit=NO_LIMIT, plan=plan, ssm_pool=q, slots=slots)[0]

    def reference(q: torch.Tensor = pool) -> torch.Tensor:
        ys = []
        for r in range(len(lengths)):
            rows = slice(cu[r], cu[r + 1])
            seg = [t[k][rows] for k in ("x", "dt", "b", "c")]
            ys.append(ref.ssd_prefill(*seg, SsdParams(t["a"], t["d"], t["dt_bias"], NO_LIMIT, s.chunk), q, r + 1))
        return torch.cat(ys)

    e = t["x"].element_size()
    per_row = h * p * (e + 4) + h * e + 2 * s.n_groups * n * e  # x, y (fp32), dt, B, C
    case = Case(
        f"ssd_prefill L={'+'.join(map(str, lengths))}",
        total * per_row + len(lengths) * 2 * h * p * n * 4,
        {"triton": tri, "reference": reference},
        _with_pool(pool, slots, reference),
        {"triton": _with_pool(pool, slots, tri)},
    )
    scan = _optional("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    if scan is not None and len(lengths) == 1:
        case.impls["mamba_ssm"] = lambda: scan(
            t["x"][None],
            t["dt"][None],
            t["a"],
            t["b"][None],
            t["c"][None],
            s.chunk,
            D=t["d"],
            dt_bias=t["dt_bias"],
            initial_states=pool[1:2],
            dt_softplus=True,
            return_final_states=True,
        )
    return case


def attn_decode_case(s: ModelShape, batch: int, ctx: int, dev: torch.device, dt: torch.dtype) -> Case:
    kvh, d = s.kv_heads, s.attn_head_dim
    k_pool = torch.randn(batch * ctx + 1, kvh, d, device=dev, dtype=dt)
    v_pool = torch.randn_like(k_pool)
    # each request's slots contiguous (what a fresh radix-cache allocation gives), requests shuffled
    kv_idx = (torch.randperm(batch, device=dev)[:, None] * ctx + torch.arange(ctx, device=dev)[None] + 1).long()
    lengths = torch.full((batch,), ctx, device=dev, dtype=torch.int64)
    q = torch.randn(batch, s.attn_heads, d, device=dev, dtype=dt)
    tri, ref = TritonOps(), ReferenceOps(batch_invariant=False)
    e = q.element_size()
    return Case(
        f"attn_decode B={batch} ctx={ctx}",
        batch * (2 * ctx * kvh * d * e + ctx * 8 + 2 * s.attn_heads * d * e),
        {
            "triton": lambda: tri.attn_decode(q, k_pool, v_pool, kv_idx, lengths, 0.125),
            "reference": lambda: ref.attn_decode(q, k_pool, v_pool, kv_idx, lengths, 0.125),
        },
        lambda: ref.attn_decode(q, k_pool, v_pool, kv_idx, lengths, 0.125),
        {"triton": lambda: tri.attn_decode(q, k_pool, v_pool, kv_idx, lengths, 0.125)},
    )


def attn_prefill_case(s: ModelShape, lengths: list[int], start: int, dev: torch.device, dt: torch.dtype) -> Case:
    kvh, d, h = s.kv_heads, s.attn_head_dim, s.attn_heads
    kv_lens = [start + n for n in lengths]
    k_pool = torch.randn(sum(kv_lens) + 1, kvh, d, device=dev, dtype=dt)
    v_pool = torch.randn_like(k_pool)
    kv_idx = torch.arange(1, sum(kv_lens) + 1, device=dev)
    q = torch.randn(sum(lengths), h, d, device=dev, dtype=dt)
    cu_q, cu_kv = _cu(lengths, dev), _cu(kv_lens, dev)
    cq, ckv = cu_q.tolist(), cu_kv.tolist()
    ref = ReferenceOps(batch_invariant=False)

    def tri() -> torch.Tensor:
        return attn_prefill_varlen(q, k_pool, v_pool, kv_idx, cu_q, cu_kv, max(lengths), 0.125)

    def reference() -> torch.Tensor:
        outs = [
            ref.attn_prefill(q[cq[r] : cq[r + 1]], k_pool, v_pool, kv_idx[ckv[r] : ckv[r + 1]], start, 0.125)
            for r in range(len(lengths))
        ]
        return torch.cat(outs)

    e = q.element_size()
    case = Case(
        f"attn_prefill L={'+'.join(map(str, lengths))} prefix={start}",
        2 * sum(lengths) * h * d * e + sum(kv_lens) * (2 * kvh * d * e + 8),
        {"triton": tri},
        reference,
        {"triton": tri},
    )
    if max(n * t for n, t in zip(lengths, kv_lens, strict=True)) * h * 4 * 3 <= REF_ATTN_MAX_BYTES:
        case.impls["reference"] = reference
    else:
        case.check_ref = None
    return case


def build_cases(
    s: ModelShape, dev: torch.device, dt: torch.dtype, quick: bool, cpu_tiny: bool = False
) -> Iterator[Case]:
    """Every case for one model shape (a few with `quick`; tiny CPU shapes with `cpu_tiny`), built one
    at a time so only one case's tensors are alive."""
    if cpu_tiny:
        s, batches, ctxs, prompts, ragged = CPU_TINY, [1, 8], [64], [[64]], [[40, 9]]
    elif quick:
        batches, ctxs, prompts, ragged = [1, 64, 256], [4096], [[2048], [8192]], [[1024] * 4]
    else:
        batches, ctxs = [1, 8, 32, 64, 128, 256], [1024, 4096]
        prompts, ragged = [[512], [2048], [8192]], [[1024] * 4, [8192, 100, 3000, 17]]
    for b in batches:
        yield conv_decode_case(s, b, dev, dt)
        yield ssd_decode_case(s, b, dev, dt)
        for c in ctxs:
            yield attn_decode_case(s, b, c, dev, dt)
    for lengths in prompts + ragged:
        yield conv_prefill_case(s, lengths, dev, dt)
        yield ssd_prefill_case(s, lengths, dev, dt)
        yield attn_prefill_case(s, lengths, 0, dev, dt)
    if not cpu_tiny:
        yield attn_prefill_case(s, [1024], 4096, dev, dt)  # a chunk continuing a cached prefix


def main(argv: Sequence[str] | None = None) -> int:
    """List the cases bench_kernels would time: name, minimum bytes moved, implementations."""
    p = argparse.ArgumentParser(description="List bench_kernels' cases (nothing is timed).")
    p.add_argument("--preset", choices=("cpu-tiny", *PRESETS), default="cpu-tiny")
    p.add_argument("--quick", action="store_true", help="a few representative shapes only")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = p.parse_args(argv)
    tiny = args.preset == "cpu-tiny"
    shape = CPU_TINY if tiny else PRESETS[args.preset]
    n = 0
    for case in build_cases(shape, torch.device(args.device), getattr(torch, args.dtype), args.quick, cpu_tiny=tiny):
        ref = "reference checked" if case.check_ref is not None else "reference too large"
        print(f"{case.name}: {case.bytes / 2**20:.2f} MiB moved; {', '.join(case.impls)}; {ref}")
        n += 1
    print(f"{n} cases ({args.preset}{', quick' if args.quick else ''}, {args.device}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
