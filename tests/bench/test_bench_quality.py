"""benchmarks/bench_quality.py on tiny inputs: every mode is measured against the baseline on the same
tokens, the baseline compared with itself changes nothing, and the JSON holds what the table shows; the
state round trip (--small) stores and resumes every state dtype's state at each block end, the float32
one exactly as the uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_quality


def test_every_mode_is_measured_against_the_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.json"
    results = bench_quality.main(["--tokens", "200", "--chunk", "64", "--greedy-tokens", "8", "--threads", "1",
                                  "--modes", "int8,int4,state:float32,state:int8", "--output-json", str(out),
                                  "--roundtrip-tokens", "0"])  # fmt: skip
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
    with pytest.raises(SystemExit):
        bench_quality.main(["--state-dtypes", "float32,fp4"])
    assert "unknown state dtype(s) fp4 for --state-dtypes (known: float32, bfloat16, int8)" in capsys.readouterr().err


def test_small_state_round_trip_of_every_state_dtype(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.json"
    results = bench_quality.main(["--small", "--modes", "", "--threads", "1", "--output-json", str(out)])
    trip = results["state_roundtrip"]
    assert (trip["tokens"], trip["store_every"], trip["window"], trip["prompt_len"]) == (192, 64, 64, 64)
    by = {r["state_dtype"]: r for r in trip["results"]}
    assert list(by) == ["float32", "bfloat16", "int8"]  # every --mamba-ssm-dtype choice
    for r in by.values():
        assert r["resumes"] == 3  # at positions 64 (the prompt's end), 128 and 192
        assert len(r["max_logit_diff"]) == len(r["forced_top1"]) == len(r["free_agreement"]) == 3  # 192 / 64
        assert all(0.0 <= a <= 1.0 for a in r["forced_top1"] + r["free_agreement"])
    fp32 = by["float32"]  # storing and resuming is lossless: exactly the uninterrupted run
    assert fp32["overall"]["max_logit_diff"] == 0.0 and fp32["first_divergence"] is None
    assert fp32["forced_top1"] == fp32["free_agreement"] == [1.0, 1.0, 1.0]
    for sd in ("bfloat16", "int8"):
        assert 0.0 < by[sd]["overall"]["mean_logit_diff"] <= by[sd]["overall"]["max_logit_diff"]
        assert by[sd]["overall"]["max_logit_diff"] == max(by[sd]["max_logit_diff"])
    assert by["bfloat16"]["overall"]["mean_logit_diff"] < by["int8"]["overall"]["mean_logit_diff"]
    assert json.loads(out.read_text())["state_roundtrip"] == trip
    text = capsys.readouterr().out
    assert "stored and resumed every 64 tokens, against the uninterrupted float32 run" in text
    assert "int8: 3 resumes" in text and "    128-191 |" in text
