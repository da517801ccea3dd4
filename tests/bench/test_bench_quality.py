"""benchmarks/bench_quality.py on tiny inputs: every mode is measured against the baseline on the same
tokens, the baseline compared with itself changes nothing, and the JSON holds what the table shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_quality


def test_every_mode_is_measured_against_the_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.json"
    results = bench_quality.main(["--tokens", "200", "--chunk", "64", "--greedy-tokens", "8", "--threads", "1",
                                  "--modes", "int8,int4,state:float32,state:int8", "--output-json", str(out)])
    assert list(results) == ["baseline", "int8", "int4", "state:float32", "state:int8"]
    base = results["baseline"]
    assert base["tokens"] == 200 and 1.0 < base["perplexity"] < 260.0 * 4
    assert len(base["perplexity_by_chunk"]) == 4  # 199 scored positions in 64-token chunks
    same = results["state:float32"]  # the baseline's own configuration: nothing may change
    assert same["perplexity_change_pct"] == 0.0 and same["greedy_first_divergence"] is None
    assert same["greedy_forced_agreement"] == 1.0
    for name in ("int8", "int4", "state:int8"):
        r = results[name]
        assert abs(r["perplexity_change_pct"]) < 10.0 and 0.0 <= r["greedy_forced_agreement"] <= 1.0
    doc = json.loads(out.read_text())
    assert doc["results"]["int8"]["perplexity"] == pytest.approx(results["int8"]["perplexity"])
    assert not any(k.startswith("_") for r in doc["results"].values() for k in r)
    table = capsys.readouterr().out
    assert "state:int8" in table and "next token agrees" in table


def test_an_unknown_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_quality.main(["--modes", "int3"])
    assert "unknown mode 'int3'" in capsys.readouterr().err
