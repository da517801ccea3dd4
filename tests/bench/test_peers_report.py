"""bench_peers' report: table/ratio/median logic on fixed inputs, the skip messages its notes carry, the
dtype line in the table and the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_peers import PeersConfig, default_llama_server, llama_skip_reason, transformers_skip_reason
from benchmarks.peers_report import format_table, median_runs, ratio, to_json

pytestmark = pytest.mark.timeout(120)


def test_median_ignores_missing_and_ratio_direction() -> None:
    runs = [{"tps_c1": 2.0, "ttft_cold_ms": 900.0}, {"tps_c1": 4.0, "ttft_cold_ms": None},
            {"tps_c1": 3.0, "ttft_cold_ms": float("nan")}]  # fmt: skip
    med = median_runs(runs)
    assert med["tps_c1"] == 3.0 and med["ttft_cold_ms"] == 900.0 and med["tps_c8"] is None
    assert ratio(3.0, 1.5) == 2.0 and ratio(None, 1.0) is None and ratio(1.0, 0.0) is None


def test_table_values_ratios_and_notes() -> None:
    results = {
        "hyssm": {"tps_c1": 6.0, "tps_c8": 30.0, "ttft_cold_ms": 500.0, "ttft_prefix_ms": 40.0,
                  "ttft_shared_ms": 90.0, "decode_ms": 100.0, "peak_rss_mib": 2048.0},
        "llama.cpp": {"tps_c1": 12.0, "tps_c8": 25.0, "ttft_cold_ms": 1000.0, "ttft_prefix_ms": 50.0,
                      "ttft_shared_ms": 60.0, "decode_ms": 50.0, "peak_rss_mib": 1024.0},
        "transformers": {"ttft_shared_ms": 300.0},
    }
    table = format_table(results, ["transformers: skipped (--skip-transformers)"])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()
            if line.startswith("| ") and "metric" not in line}  # fmt: skip
    c1 = rows["out tok/s, concurrency 1 (tf: batch 1) [higher is better]"]
    assert c1 == ["6.00", "12.00", "-", "0.50x", "-"]  # behind: no '+'
    assert rows["out tok/s, concurrency 8 (tf: static batch 8) [higher is better]"][3] == "1.20x +"
    assert rows["TTFT ms, cold prompt [lower is better]"][:4] == ["500", "1000", "-", "0.50x +"]  # lower wins
    labels = list(rows)
    cont = "TTFT ms, continuation of a cached prompt (tf: whole prompt) [lower is better]"
    shared = "TTFT ms, shared prefix + new suffix, third request (tf: whole prompt) [lower is better]"
    assert labels.index(shared) == labels.index(cont) + 1  # the new row right after the continuation row
    assert rows[cont] == ["40.00", "50.00", "-", "0.80x +", "-"]
    assert rows[shared] == ["90.00", "60.00", "300", "1.50x", "0.30x +"]
    assert rows["ms per decode token, concurrency 1 [lower is better]"][3] == "2.00x"
    assert rows["peak RSS MiB (process tree) [lower is better]"][:4] == ["2048", "1024", "-", "2.00x"]
    assert rows["out tok/s, concurrency 32 (tf: static batch 32) [higher is better]"] == ["-"] * 5
    assert table.splitlines()[-1] == "note: transformers: skipped (--skip-transformers)"
    doc = json.loads(to_json(results, {"hyssm": [results["hyssm"]]}, [], {"runs": 1}),
                     parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))  # fmt: skip
    assert doc["ratios"]["hyssm/llama.cpp"]["tps_c8"] == pytest.approx(1.2)
    assert doc["ratios"]["hyssm/transformers"]["tps_c1"] is None
    assert doc["ratios"]["hyssm/transformers"]["ttft_shared_ms"] == pytest.approx(0.3)


def test_skip_messages(tmp_path: Path) -> None:
    script = tmp_path / "llama-server.sh"
    script.write_text("#!/bin/bash\nROOT=x\nVER=9.9.9  # pinned\n")
    cfg = PeersConfig(model="m", peers_script=str(script))
    expected = default_llama_server(str(script))
    assert expected is not None and expected.parts[-6:] == (
        "llama_cpp_python-9.9.9", "vendor", "llama.cpp", "build", "bin", "llama-server")  # fmt: skip
    msg = llama_skip_reason(cfg)
    assert msg is not None and str(expected) in msg and f"bash {script} build" in msg and "--llama-server" in msg
    assert llama_skip_reason(PeersConfig(model="m", skip_llama=True)) == "llama.cpp: skipped (--skip-llama)"
    fake_bin = tmp_path / "llama-server"
    fake_bin.write_text("#!/bin/sh\n")
    fake_bin.chmod(0o755)
    assert llama_skip_reason(PeersConfig(model="m", llama_server=str(fake_bin))) is None
    missing = transformers_skip_reason(cfg, find_spec=lambda name: None)
    assert missing is not None and "not installed" in missing
    assert transformers_skip_reason(cfg, find_spec=lambda name: object()) is None
    assert transformers_skip_reason(PeersConfig(model="m", skip_transformers=True)) == (
        "transformers: skipped (--skip-transformers)")  # fmt: skip


def test_dtype_line_in_the_table_and_the_json() -> None:
    results = {"hyssm": {"tps_c1": 6.0}}
    table = format_table(results, ["a note"], dtype="bfloat16")
    assert table.splitlines()[-2:] == [
        "weights: bfloat16 (hyssm --dtype / --quantization, llama.cpp's GGUF type, transformers' dtype)",
        "note: a note"]  # fmt: skip
    assert "weights:" not in format_table(results, ["a note"])
    assert json.loads(to_json(results, {}, [], {"dtype": "bfloat16"}, dtype="bfloat16"))["dtype"] == "bfloat16"
