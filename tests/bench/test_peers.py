"""bench_peers' processes and command line: /proc parsing, process start/readiness/RSS/stop with real
processes, the servers up together with their runs alternating, SIGTERM stopping the servers a benchmark
started, the CLI's validation, and one real run of hyssm's built-in model (llama.cpp and transformers
skipped, as in CI). The report, the prompts and the HTTP measurement, GGUF staging, and dtype /
quantization are in test_peers_report.py, test_peers_prompts.py, test_peers_gguf.py and test_peers_dtype.py."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks import bench_peers
from benchmarks.bench_peers import PeersConfig, ServerSpec, main, parse_args, run_servers
from benchmarks.peers_procs import ManagedProcess, PeerError, free_port, parse_ppid, parse_vmrss_kb, process_tree
from tests.bench.peers_helpers import BUILTIN, CHILD

pytestmark = pytest.mark.timeout(120)


def test_proc_parsers() -> None:
    assert parse_ppid("123 (a (b) c) S 77 123 123 0 -1") == 77
    assert parse_vmrss_kb("Name:\tx\nVmRSS:\t  4096 kB\nThreads: 1\n") == 4096
    assert parse_vmrss_kb("Name:\tzombie\n") == 0


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


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_servers_are_up_together_and_their_runs_alternate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_servers` starts every server, then measures run 1 of each, run 2 of each, ... while the others
    wait up; a server that fails to start or in a run is stopped and noted, the others are measured to the
    end with their peak RSS; none is left running."""
    ports = [free_port() for _ in range(3)]
    specs = [ServerSpec(f"s{i}", [sys.executable, "-c", CHILD, str(port)], port, "lost" if i == 1 else "hyssm")
             for i, port in enumerate(ports)]  # fmt: skip
    specs.insert(1, ServerSpec("early", [sys.executable, "-c", "import sys; sys.exit(3)"], free_port(), "hyssm"))
    calls: list[tuple[str, int, bool, bool]] = []

    async def fake_measure(base_url: str, backend: str, run: dict, cfg: PeersConfig, warmup: bool,
                           pid: int | None = None) -> dict:  # fmt: skip
        port = int(base_url.rsplit(":", 1)[1])
        assert pid is not None and _answers(port) and pid in process_tree(pid)  # the server's own process
        others_up = all(_answers(p) for p in ports if p != port and not (p == ports[1] and run["k"] >= 1))
        calls.append((f"s{ports.index(port)}", run["k"], warmup, others_up))
        if backend == "lost" and run["k"] == 1:
            raise PeerError("connection lost")
        return {"tps_c1": float(run["k"])}

    monkeypatch.setattr(bench_peers, "measure_http", fake_measure)
    cfg = PeersConfig(model="m", ready_timeout_s=30)
    out, notes = run_servers(specs, [{"k": k} for k in range(3)], cfg, tmp_path)  # type: ignore[misc]
    assert [c[:3] for c in calls] == [("s0", 0, True), ("s1", 0, True), ("s2", 0, True), ("s0", 1, False),
                                      ("s1", 1, False), ("s2", 1, False), ("s0", 2, False), ("s2", 2, False)]
    assert all(c[3] for c in calls)
    assert set(out) == {"s0", "s2"} and [m["tps_c1"] for m in out["s0"]] == [0.0, 1.0, 2.0]
    assert all(m["peak_rss_mib"] > 1 for m in out["s0"] + out["s2"])
    assert len(notes) == 2 and notes[0].startswith("early: failed: early exited with 3 before it was ready")
    assert notes[1].startswith("s1: failed: connection lost\n--- s1 log tail ---")
    assert not any(_answers(p) for p in ports)


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
    assert not parse_args(["--model", BUILTIN]).sequential
    assert parse_args(["--model", BUILTIN, "--sequential"]).sequential
    cfg = parse_args(["--model", BUILTIN, "--hyssm-args", "--max-mamba-cache-size 64 --log-level warning"])
    assert cfg.hyssm_args == ("--max-mamba-cache-size", "64", "--log-level", "warning")
    assert cfg.dtype == "float32" and parse_args(["--model", BUILTIN, "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", BUILTIN, "--dtype", "float16"])
    assert exc.value.code == 2
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        PeersConfig(model="m", dtype="float16")


def test_main_on_the_builtin_model_with_peers_skipped(tmp_path: Path, capsys) -> None:
    out = tmp_path / "peers.json"
    flags = ["--model", BUILTIN, "--runs", "1", "--levels", "1,2", "--input-len", "8", "--output-len", "3",
             "--prefix-len", "16", "--suffix-len", "4", "--skip-llama", "--skip-transformers", "--log-dir",
             str(tmp_path / "logs"), "--output-json", str(out), "--ready-timeout", "90",
             "--settle-quiet", "0.1"]  # fmt: skip
    png = tmp_path / "peers.png"
    if importlib.util.find_spec("matplotlib") is not None:
        flags += ["--plot", str(png)]
    assert main(flags) == 0
    table = capsys.readouterr().out
    assert "note: llama.cpp: skipped (--skip-llama)" in table
    assert "note: transformers: skipped (--skip-transformers)" in table
    doc = json.loads(out.read_text())
    hy = doc["medians"]["hyssm"]
    assert hy["tps_c1"] > 0 and hy["tps_c8"] is None and hy["ttft_prefix_ms"] > 0 and hy["peak_rss_mib"] > 50
    assert hy["ttft_shared_ms"] > 0 and "shared prefix: a new 16-token prefix with 3 distinct 4-token" in table
    # hyssm's configuration, with the pools its server reported, in the table and the JSON
    line = r"^config: (hyssm: launch\.py .*KV pool (\d+) token slots.*?, (\d+) recurrent-state slots.*)$"
    kv = re.search(line, table, re.M)
    assert kv is not None and int(kv.group(2)) > 0 and int(kv.group(3)) > 0, table
    assert doc["configs"] == {"hyssm": kv.group(1)}
    assert all(doc["runs"]["hyssm"][0][f"settle_{k}_s"] >= 0.1 for k in ("cold", "prefix", "shared"))
    assert set(doc["medians"]) == {"hyssm"} and (tmp_path / "logs" / "hyssm.log").is_file()
    if "--plot" in flags:  # the figure of the table: a PNG whose throughput line is the JSON's tps_c1
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        from benchmarks.bench_plots import plot_peers

        line = plot_peers(doc["medians"]).axes[0].get_lines()[0]
        assert line.get_label() == "hyssm" and [tuple(xy) for xy in line.get_xydata()] == [(1.0, hy["tps_c1"])]


STOPPED_ON_SIGTERM = """
import sys, time
from pathlib import Path
from benchmarks.peers_procs import ManagedProcess, stop_on_sigterm

with stop_on_sigterm():
    child = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], Path(sys.argv[1]))
    try:
        print(child.proc.pid, flush=True)
        time.sleep(600)
    finally:
        child.stop()
"""


def test_sigterm_to_a_benchmark_stops_the_servers_it_started(tmp_path: Path) -> None:
    """bench_peers and soak run their servers inside stop_on_sigterm: a SIGTERM to the benchmark stops
    them too (by default Python would exit at once and leave them running)."""
    import signal
    import subprocess

    bench = subprocess.Popen([sys.executable, "-c", STOPPED_ON_SIGTERM, str(tmp_path / "child.log")],
                             cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert bench.stdout is not None
        child = int(bench.stdout.readline())
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=30)
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
    finally:
        bench.kill()
        bench.wait()
