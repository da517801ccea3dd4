"""benchmarks/bench_state_drift.py on tiny inputs: the report's shape, and figures that follow from the definitions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_state_drift
from tests.worker.util import fixture_dir


def test_drift_report_on_a_fixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "drift.json"
    argv = ["--model-path", fixture_dir("qwen3_5_dense"), "--tokens", "20", "--window", "8", "--threads", "1",
            "--dtypes", "float32,bfloat16,int8", "--output-json", str(out)]  # fmt: skip
    results = bench_state_drift.main(argv)
    text = capsys.readouterr().out
    assert "20 greedy tokens" in text and "bytes per state slot: float32" in text
    data = json.loads(out.read_text())
    assert data["tokens"] == 20 and data["window"] == 8 and data["results"] == results
    by = {r["state_dtype"]: r for r in results}
    assert set(by) == {"float32", "bfloat16", "int8"}
    assert data["bytes_per_state_slot"]["int8"] < data["bytes_per_state_slot"]["bfloat16"] < (
        data["bytes_per_state_slot"]["float32"])
    # the float32 lanes compute exactly what the reference does: no drift at all
    fp32 = by["float32"]
    assert fp32["first_divergence"] is None and fp32["overall"]["rel_error_max"] == 0.0
    assert fp32["free_agreement"] == [1.0, 1.0, 1.0] and fp32["forced_top1"] == [1.0, 1.0, 1.0]
    for sd in ("bfloat16", "int8"):
        r = by[sd]
        assert len(r["free_agreement"]) == len(r["rel_error_mean"]) == 3  # windows 0-7, 8-15, 16-19
        assert 0.0 < r["overall"]["rel_error_mean"] <= r["overall"]["rel_error_max"]
        assert all(0.0 <= a <= 1.0 for a in r["free_agreement"] + r["forced_top1"])
        assert r["overall"]["kl_mean"] >= 0.0
        if r["first_divergence"] is not None:
            assert r["first_divergence"] < 20 and r["overall"]["free_agreement"] < 1.0
    assert by["bfloat16"]["overall"]["rel_error_mean"] < by["int8"]["overall"]["rel_error_mean"]


def test_drift_definitions() -> None:
    d = bench_state_drift.Drift("int8", free_agree=[True, True, False, True], forced_top1=[True] * 4,
                                rel_error=[0.0, 0.1, 0.2, 0.3], kl=[0.0] * 4)  # fmt: skip
    assert d.first_divergence == 2
    s = bench_state_drift.summary(d, 3)
    assert s["free_agreement"] == [pytest.approx(2 / 3), 1.0]
    assert s["rel_error_max"] == [0.2, 0.3] and s["overall"]["rel_error_max"] == 0.3
    assert bench_state_drift.Drift("bfloat16", free_agree=[True] * 3).first_divergence is None
