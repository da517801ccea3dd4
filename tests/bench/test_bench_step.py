"""benchmarks/bench_step.py runs the real runner and prints one row per batch size and the one-row step's
floor beside it (no timing asserted)."""

from __future__ import annotations

import re

import pytest

from benchmarks import bench_step


@pytest.mark.parametrize("deterministic", [False, True])
def test_bench_step_table(capsys: pytest.CaptureFixture[str], deterministic: bool) -> None:
    argv = ["--threads", "1", "--batches", "1,3", "--prompt-len", "20", "--decode-steps", "3", "--runs", "1"]
    bench_step.main(argv + (["--deterministic"] if deterministic else []))
    out = capsys.readouterr().out.splitlines()
    assert ("deterministic mode, reference kernels" if deterministic else "default mode, native kernels") in out[0]
    rows = [line.split("|") for line in out[2:4]]
    assert [int(r[0]) for r in rows] == [1, 3]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    floor = re.search(r"floor .*: ([0-9.]+) ms; batch-1 step / floor, run by run: ([0-9.]+) \(median", out[4])
    assert floor is not None and float(floor.group(1)) > 0 and float(floor.group(2)) > 0, out[4]
