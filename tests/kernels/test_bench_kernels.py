"""benchmarks/bench_kernels.py on CPU: its cases (tiny shapes, interpreted kernels) check and time cleanly."""

from __future__ import annotations

import torch

from benchmarks.bench_kernels import format_rows, main, run_case
from benchmarks.bench_kernels_cases import CPU_TINY, build_cases
from tests.kernels.util import TOL


def test_every_case_matches_the_reference_and_times() -> None:
    torch.manual_seed(0)
    cases = list(build_cases(CPU_TINY, torch.device("cpu"), torch.float32, quick=True, cpu_tiny=True))
    kinds = {c.name.split()[0] for c in cases}
    assert kinds == {"conv_decode", "ssd_decode", "attn_decode", "conv_prefill", "ssd_prefill", "attn_prefill"}
    rows = [row for case in cases for row in run_case(case, "cpu", 1, torch.device("cpu"), None)]
    assert format_rows(rows).count("\n") == len(rows) + 1
    triton_rows = [r for r in rows if r.impl == "triton"]
    assert len(triton_rows) == len(cases)
    for r in rows:
        assert r.note == "" and r.us is not None and r.us > 0 and r.gbps is not None, r
    for r in triton_rows:
        assert r.max_err is not None and r.max_err <= TOL, r


def test_without_a_gpu_it_says_so_and_succeeds(capsys) -> None:
    if torch.cuda.is_available():
        return
    assert main([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


def test_device_cuda_without_a_gpu_is_an_error(capsys) -> None:
    if torch.cuda.is_available():
        return
    assert main(["--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().out
