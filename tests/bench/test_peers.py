"""bench_peers: table/ratio/median logic on fixed inputs, skip messages, prompts, the HTTP measurement
against the fake server, process start/readiness/RSS/stop with real processes, and one real run of
hyssm's built-in model (llama.cpp and transformers skipped, as in CI)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from benchmarks.bench_peers import (
    PeersConfig,
    default_llama_server,
    llama_skip_reason,
    main,
    make_prompts,
    measure_http,
    parse_args,
    transformers_skip_reason,
)
from benchmarks.peers_procs import ManagedProcess, PeerError, free_port, parse_ppid, parse_vmrss_kb, process_tree
from benchmarks.peers_report import format_table, median_runs, ratio, to_json
from tests.bench.fake_server import VOCAB_SIZE, FakeServer

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
BUILTIN = str(REPO / "worker_proc" / "builtin_model")


def test_median_ignores_missing_and_ratio_direction() -> None:
    runs = [{"tps_c1": 2.0, "ttft_cold_ms": 900.0}, {"tps_c1": 4.0, "ttft_cold_ms": None},
            {"tps_c1": 3.0, "ttft_cold_ms": float("nan")}]  # fmt: skip
    med = median_runs(runs)
    assert med["tps_c1"] == 3.0 and med["ttft_cold_ms"] == 900.0 and med["tps_c8"] is None
    assert ratio(3.0, 1.5) == 2.0 and ratio(None, 1.0) is None and ratio(1.0, 0.0) is None


def test_table_values_ratios_and_notes() -> None:
    results = {
        "hyssm": {"tps_c1": 6.0, "tps_c8": 30.0, "ttft_cold_ms": 500.0, "decode_ms": 100.0, "peak_rss_mib": 2048.0},
        "llama.cpp": {"tps_c1": 12.0, "tps_c8": 25.0, "ttft_cold_ms": 1000.0, "decode_ms": 50.0,
                      "peak_rss_mib": 1024.0},
    }
    table = format_table(results, ["transformers: skipped (--skip-transformers)"])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()
            if line.startswith("| ") and "metric" not in line}  # fmt: skip
    c1 = rows["out tok/s, concurrency 1 (tf: batch 1) [higher is better]"]
    assert c1 == ["6.00", "12.00", "-", "0.50x", "-"]  # behind: no '+'
    assert rows["out tok/s, concurrency 8 (tf: static batch 8) [higher is better]"][3] == "1.20x +"
    assert rows["TTFT ms, cold prompt [lower is better]"][:4] == ["500", "1000", "-", "0.50x +"]  # lower wins
    assert rows["ms per decode token, concurrency 1 [lower is better]"][3] == "2.00x"
    assert rows["peak RSS MiB (process tree) [lower is better]"][:4] == ["2048", "1024", "-", "2.00x"]
    assert rows["out tok/s, concurrency 32 (tf: static batch 32) [higher is better]"] == ["-"] * 5
    assert table.splitlines()[-1] == "note: transformers: skipped (--skip-transformers)"
    doc = json.loads(to_json(results, {"hyssm": [results["hyssm"]]}, [], {"runs": 1}),
                     parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))  # fmt: skip
    assert doc["ratios"]["hyssm/llama.cpp"]["tps_c8"] == pytest.approx(1.2)
    assert doc["ratios"]["hyssm/transformers"]["tps_c1"] is None


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


def test_prompts_are_shared_distinct_and_avoid_special_ids() -> None:
    cfg = PeersConfig(model="m", runs=2, levels=(1, 3), input_len=10, prefix_len=20, suffix_len=5)
    a, b = make_prompts(cfg, 50, {0, 1, 2}), make_prompts(cfg, 50, {0, 1, 2})
    assert a == b and a[0] != a[1]  # same for every system; runs differ
    run = a[0]
    flat = [p for c in (1, 3) for p in run["throughput"][c]] + run["cold"]  # type: ignore[index, operator]
    assert len({tuple(p) for p in flat}) == 5 and all(len(p) == 10 for p in flat)
    assert run["prefix"][0][:20] == run["prefix_only"][0] and len(run["prefix"][0]) == 25  # type: ignore[index]
    assert not {0, 1, 2} & {t for p in flat + run["prefix"] for t in p}  # type: ignore[operator]


@pytest.mark.parametrize("backend", ["hyssm", "llama-server"])
def test_measure_http_against_the_fake(server: FakeServer, backend: str) -> None:
    server.reset()
    cfg = PeersConfig(model="m", runs=1, levels=(1, 4), input_len=6, output_len=5, prefix_len=12, suffix_len=3)
    run = make_prompts(cfg, VOCAB_SIZE, set())[0]
    m = asyncio.run(measure_http(server.base_url, backend, run, cfg, warmup=True))
    seen = server.state.seen
    assert len(seen) == 1 + 1 + 4 + 1 + 2  # warm-up, c=1, c=4, cold, prefix, prefix hit
    assert [s.max_tokens for s in seen] == [2, 5, 5, 5, 5, 5, 1, 1, 1]
    assert seen[-1].prompt_ids[:12] == seen[-2].prompt_ids and seen[-1].cached_tokens == 12
    assert set(m) == {"tps_c1", "tps_c4", "decode_ms", "ttft_cold_ms", "ttft_prefix_ms"}
    assert all(v > 0 for v in m.values())
    assert m["tps_c4"] > m["tps_c1"]  # four streams in parallel against the fake's fixed pace


def test_measure_http_raises_on_failed_requests(server: FakeServer) -> None:
    server.reset(fail_every=2)
    cfg = PeersConfig(model="m", runs=1, levels=(1, 2), input_len=4, output_len=2, prefix_len=4, suffix_len=2)
    with pytest.raises(PeerError, match="1 of 2 requests failed, first: RuntimeError: HTTP 503"):
        asyncio.run(measure_http(server.base_url, "hyssm", make_prompts(cfg, VOCAB_SIZE, set())[0], cfg, False))


def test_proc_parsers() -> None:
    assert parse_ppid("123 (a (b) c) S 77 123 123 0 -1") == 77
    assert parse_vmrss_kb("Name:\tx\nVmRSS:\t  4096 kB\nThreads: 1\n") == 4096
    assert parse_vmrss_kb("Name:\tzombie\n") == 0


CHILD = """
import http.server, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("grandchild", grandchild.pid, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_managed_process_ready_rss_and_group_stop(tmp_path: Path) -> None:
    port = free_port()
    proc = ManagedProcess("child", [sys.executable, "-c", CHILD, str(port)], tmp_path / "child.log")
    try:
        assert proc.wait_ready(f"http://127.0.0.1:{port}/health", 30) >= 0
        deadline = time.monotonic() + 10
        while len(process_tree(proc.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the grandchild appears in /proc shortly after the health probe passes
        tree = process_tree(proc.proc.pid)
        assert len(tree) == 2 and proc.proc.pid in tree
    finally:
        proc.stop(grace_s=5)
    grandchild = next(p for p in tree if p != proc.proc.pid)
    assert proc.proc.returncode is not None and proc.peak_rss_bytes > 1 << 20
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:
        time.sleep(0.05)  # init reaps the killed grandchild
    assert not os.path.exists(f"/proc/{grandchild}") or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]


def test_process_exiting_before_ready_reports_its_log(tmp_path: Path) -> None:
    code = "import sys; print('bad model path', flush=True); sys.exit(3)"
    proc = ManagedProcess("early", [sys.executable, "-c", code], tmp_path / "early.log")
    try:
        with pytest.raises(PeerError, match="exited with 3 before it was ready:\nbad model path"):
            proc.wait_ready(f"http://127.0.0.1:{free_port()}/health", 30)
    finally:
        proc.stop()


def test_cli_validation(tmp_path: Path) -> None:
    for flags in (["--model", BUILTIN, "--levels", "8,32"], ["--model", BUILTIN, "--levels", "x"],
                  ["--model", str(tmp_path)], ["--model", BUILTIN, "--runs", "0"]):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            parse_args(flags)
        assert exc.value.code == 2
    assert parse_args(["--model", BUILTIN]).levels == (1, 8, 32)
    cfg = parse_args(["--model", BUILTIN, "--hyssm-args", "--max-mamba-cache-size 64 --log-level warning"])
    assert cfg.hyssm_args == ("--max-mamba-cache-size", "64", "--log-level", "warning")


def test_main_on_the_builtin_model_with_peers_skipped(tmp_path: Path, capsys) -> None:
    out = tmp_path / "peers.json"
    flags = ["--model", BUILTIN, "--runs", "1", "--levels", "1,2", "--input-len", "8", "--output-len", "3",
             "--prefix-len", "16", "--suffix-len", "4", "--skip-llama", "--skip-transformers", "--log-dir",
             str(tmp_path / "logs"), "--output-json", str(out), "--ready-timeout", "90"]  # fmt: skip
    assert main(flags) == 0
    table = capsys.readouterr().out
    assert "note: llama.cpp: skipped (--skip-llama)" in table
    assert "note: transformers: skipped (--skip-transformers)" in table
    doc = json.loads(out.read_text())
    hy = doc["medians"]["hyssm"]
    assert hy["tps_c1"] > 0 and hy["tps_c8"] is None and hy["ttft_prefix_ms"] > 0 and hy["peak_rss_mib"] > 50
    assert set(doc["medians"]) == {"hyssm"} and (tmp_path / "logs" / "hyssm.log").is_file()
