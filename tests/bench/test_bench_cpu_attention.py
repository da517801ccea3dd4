"""benchmarks/bench_cpu_attention.py times the fused CPU attention against torch's flash attention and prints
one prefill and one decode row per context length (no timing asserted)."""

from __future__ import annotations

import pytest

from benchmarks import bench_cpu_attention
from worker_proc.kernels import native

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bench_cpu_attention_table(capsys: pytest.CaptureFixture[str], dtype: str) -> None:
    bench_cpu_attention.main(["--dtype", dtype, "--contexts", "0,100", "--chunk", "40", "--runs", "1",
                              "--threads", "1"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(dtype)
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out[3:]]
    assert [r[0] for r in rows] == ["prefill 40 after 0", "decode over 40", "prefill 40 after 100", "decode over 140"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and r[3].endswith("x") for r in rows)
