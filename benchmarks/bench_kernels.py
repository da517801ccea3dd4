"""Micro-benchmark of the Triton kernels against the pure-torch reference (and mamba_ssm / causal_conv1d).

Needs a CUDA GPU; without one it says so and exits 0, or 2 with ``--device cuda``
(``--cpu-reference`` then times the reference ops on tiny CPU shapes instead).

    python benchmarks/bench_kernels.py                      # every case, bf16, both presets
    python benchmarks/bench_kernels.py --quick --preset tiny --output-json kernels.json

Shapes are those of Granite 4.0-H (``PRESETS``): Mamba2 heads x head_dim 64, d_state 128, one group,
d_conv 4, SSD chunk 256; GQA attention over a slot-indexed KV pool. Decode cases run batch 1..256
(attention over 1k/4k-token contexts), prefill cases one or several prompts up to 8k tokens.
Each case first checks the Triton result against the reference (``max_err``, pools included), then
times both with CUDA events (median, L2 flushed before every call; the flush also hides the host-side
launch latency, so the figures are close to device time). ``GB/s`` = the bytes a kernel must move at
least (inputs read once, outputs and touched state written once) / its median time.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if __package__ in (None, ""):  # run as a file: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    from benchmarks.bench_kernels_cases import Case

logger = logging.getLogger(__name__)


@dataclass
class Row:
    """One line of the report."""

    preset: str
    case: str
    impl: str
    us: float | None
    gbps: float | None
    max_err: float | None
    note: str = ""


def time_us(fn: Callable[[], object], iters: int, device: torch.device, flush: torch.Tensor | None) -> float:
    """Median wall time of fn() in microseconds (CUDA events; L2 flushed before each call)."""
    for _ in range(3 if device.type == "cuda" else 1):  # compile / autotune / allocator warm-up
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        if flush is not None:
            flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))


def _max_err(a: object, b: object) -> float:
    """Max abs difference over (nested tuples of) tensors."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return max((_max_err(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    raise TypeError(f"cannot compare {type(a)} and {type(b)}")


def run_case(case: Case, preset: str, iters: int, device: torch.device, flush: torch.Tensor | None) -> list[Row]:
    """Check then time every implementation of one case; an implementation that fails is reported, not fatal."""
    rows: list[Row] = []
    expect = None
    try:
        if case.check_ref is not None:
            expect = case.check_ref()
    except Exception as exc:  # noqa: BLE001 - a reference OOM at 8k must not end the run
        note = f"reference check failed: {type(exc).__name__}: {exc}"[:160]
        rows.append(Row(preset, case.name, "reference", None, None, None, note))
    for impl, fn in case.impls.items():
        try:
            err = None
            if expect is not None and impl in case.checks:
                err = _max_err(case.checks[impl](), expect)
            us = time_us(fn, iters, device, flush)
            rows.append(Row(preset, case.name, impl, us, case.bytes / us / 1e3, err))
        except Exception as exc:  # noqa: BLE001 - third-party kernels may not accept this layout
            rows.append(Row(preset, case.name, impl, None, None, None, f"{type(exc).__name__}: {exc}"[:160]))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_rows(rows: Sequence[Row]) -> str:
    head = f"{'preset':7} {'case':44} {'impl':14} {'us':>10} {'GB/s':>8} {'max_err':>9}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        us = f"{r.us:10.1f}" if r.us is not None else f"{'-':>10}"
        gb = f"{r.gbps:8.0f}" if r.gbps is not None else f"{'-':>8}"
        err = f"{r.max_err:9.2e}" if r.max_err is not None else f"{'-':>9}"
        lines.append(f"{r.preset:7} {r.case:44} {r.impl:14} {us} {gb} {err}  {r.note}")
    return "\n".join(lines)


def cpu_reference(iters: int) -> list[Row]:
    """Tiny CPU timing of the reference ops (what runs where no GPU is)."""
    from benchmarks.bench_kernels_cases import PRESETS, build_cases

    rows = []
    for case in build_cases(PRESETS["tiny"], torch.device("cpu"), torch.float32, quick=True, cpu_tiny=True):
        us = time_us(case.impls["reference"], iters, torch.device("cpu"), None)
        rows.append(Row("cpu", case.name, "reference", us, case.bytes / us / 1e3, None))
    return rows


def _fixture_logits(fixture: Path, device: torch.device, ops: object) -> torch.Tensor:
    """Greedy prompt + decode logits of one parity fixture through ModelRunner with `ops` swapped in."""
    from safetensors.torch import load_file

    from shared.messages import ForwardBatch, ReqSlice, SamplingParams
    from tests.model_driver import forward_all_logits, forward_logits
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    ref = load_file(str(fixture / "reference.safetensors"))
    prompt, gen = ref["prompt"].tolist(), ref["gen_tokens"].tolist()
    runner = ModelRunner(str(fixture),
        WorkerConfig(device=str(device), kv_slots=len(prompt) + len(gen) + 1, state_slots=2))
    runner.ops = ops
    greedy = SamplingParams(temperature=0.0)

    def step(i: int, ids: list[int], start: int, all_rows: bool) -> torch.Tensor:
        req = ReqSlice(rid="a", input_ids=ids, start_pos=start, kv_slots=list(range(1, start + len(ids) + 1)),
                       state_slot=1, sample=True, sampling=greedy)  # fmt: skip
        fb = ForwardBatch(step=i, reqs=[req], clears=[1] if start == 0 else [])
        return forward_all_logits(runner, fb)["a"] if all_rows else forward_logits(runner, fb)["a"][None]

    rows = [step(0, prompt, 0, True)]
    rows += [step(i, [gen[i - 1]], len(prompt) + i - 1, False) for i in range(1, len(gen))]
    runner.check_integrity()
    return torch.cat(rows).float().cpu()


def model_parity(device: torch.device, tol: float = 1e-4) -> bool:
    """End to end on `device`: every tests/fixtures parity model, TritonOps vs ReferenceOps vs Hugging Face."""
    from safetensors.torch import load_file

    from worker_proc.kernels import ReferenceOps
    from worker_proc.kernels.triton.ops import TritonOps

    ok = True
    fixtures = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
    for fixture in sorted(p for p in fixtures.iterdir() if (p / "reference.safetensors").exists()):
        ref = load_file(str(fixture / "reference.safetensors"))
        hf = torch.cat([ref["prompt_logits"], ref["gen_logits"][1:]])
        mine = _fixture_logits(fixture, device, TritonOps())
        base = _fixture_logits(fixture, device, ReferenceOps())
        d_ref, d_hf = float((mine - base).abs().max()), float((mine - hf).abs().max())
        passed = d_ref <= tol and d_hf <= tol
        ok &= passed
        print(f"model parity {fixture.name:16s} triton-vs-reference {d_ref:.2e}  triton-vs-HF {d_hf:.2e}  "
              f"{'PASS' if passed else 'FAIL'} (tol {tol:g})")  # fmt: skip
    return ok


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=["micro", "tiny", "all"], default="all")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--quick", action="store_true", help="a few representative shapes only")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--filter", default="", help="only cases whose name contains this")
    p.add_argument("--no-reference", action="store_true", help="skip timing the pure-torch reference")
    p.add_argument("--cpu-reference", action="store_true", help="without a GPU: time the reference on CPU")
    p.add_argument("--output-json", type=Path)
    p.add_argument("--model-parity", action="store_true", help="also run the fixture models end to end (fp32)")
    p.add_argument("--device", choices=["auto", "cuda"], default="auto",
                   help="auto: the GPU if there is one, else nothing timed (exit 0); cuda: no GPU exits 2")  # fmt: skip
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU on this machine; the Triton kernels need one (nothing timed).")
        if args.device == "cuda":
            return 2
        if args.cpu_reference:
            print(format_rows(cpu_reference(args.iters)))
        return 0
    from benchmarks.bench_kernels_cases import PRESETS, build_cases  # imports triton: only with a GPU

    device = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    print(f"bench_kernels: {torch.cuda.get_device_name(device)}, dtype {args.dtype}, torch {torch.__version__}")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)  # > L2 of any current GPU
    parity_ok = model_parity(device) if args.model_parity else True
    rows: list[Row] = []
    presets = list(PRESETS) if args.preset == "all" else [args.preset]
    for name in presets:
        for case in build_cases(PRESETS[name], device, dtype, quick=args.quick):
            if args.filter not in case.name:
                continue
            if args.no_reference:
                case.impls.pop("reference", None)
            case_rows = run_case(case, name, args.iters, device, flush)
            print(format_rows(case_rows).split("\n", 2)[-1], flush=True)  # progress, without the header
            rows.extend(case_rows)
    print(format_rows(rows))
    if args.output_json:
        meta = {"device": torch.cuda.get_device_name(device), "dtype": args.dtype, "torch": torch.__version__}
        args.output_json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    failed = [r for r in rows if r.impl == "triton" and r.us is None]
    return 1 if failed or not parity_ok else 0


if __name__ == "__main__":
    sys.exit(main())
