"""bench_peers: table/ratio/median logic on fixed inputs, skip messages, prompts, the HTTP measurement
against the fake server, process start/readiness/RSS/stop with real processes, and one real run of
hyssm's built-in model (llama.cpp and transformers skipped, as in CI)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks import bench_peers
from benchmarks.bench_peers import (
    PeersConfig,
    ServerSpec,
    benchmark,
    default_llama_server,
    llama_skip_reason,
    main,
    make_prompts,
    measure_http,
    parse_args,
    run_servers,
    transformers_skip_reason,
)
from benchmarks.peers_gguf import gguf_for, placeholder_merge, safetensors_header
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


def test_prompts_are_shared_distinct_and_avoid_special_ids() -> None:
    cfg = PeersConfig(model="m", runs=2, levels=(1, 3), input_len=10, prefix_len=20, suffix_len=5)
    a, b = make_prompts(cfg, 50, {0, 1, 2}), make_prompts(cfg, 50, {0, 1, 2})
    assert a == b and a[0] != a[1]  # same for every system; runs differ
    run = a[0]
    flat = [p for c in (1, 3) for p in run["throughput"][c]] + run["cold"]  # type: ignore[index, operator]
    assert len({tuple(p) for p in flat}) == 5 and all(len(p) == 10 for p in flat)
    assert run["prefix"][0][:20] == run["prefix_only"][0] and len(run["prefix"][0]) == 25  # type: ignore[index]
    every = flat + run["prefix"] + run["shared_warm"] + run["shared"]  # type: ignore[operator]
    assert not {0, 1, 2} & {t for p in every for t in p}
    # the warm-up: one reserved id, the same in every run, in no other prompt (so the cold one shares none)
    (warm,) = run["warmup"]  # type: ignore[misc]
    assert len(warm) == 10 and len(set(warm)) == 1 and a[1]["warmup"] == run["warmup"] and warm[0] not in {0, 1, 2}
    assert all(warm[0] not in p for r in a for p in r["cold"] + r["prefix"] + r["shared_warm"] + r["shared"])  # type: ignore[operator]
    assert all(r["cold"][0][0] not in {p[0] for c in (1, 3) for p in r["throughput"][c]} for r in a)  # type: ignore[index]


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_shared_prefix_prompts() -> None:
    # a small vocabulary, so distinct first ids are a property of make_prompts, not of chance
    cfg = PeersConfig(model="m", runs=3, levels=(1, 8), input_len=10, prefix_len=20, suffix_len=5)
    for run in make_prompts(cfg, 16, {0, 1}):
        (pa, pb), (pc,) = run["shared_warm"], run["shared"]  # type: ignore[misc]
        p2 = pc[:20]
        assert len(pa) == len(pb) == len(pc) == 25 and pa[:20] == pb[:20] == p2
        assert len({pa[20], pb[20], pc[20]}) == 3  # three distinct suffixes, so exactly P2 is shared
        assert _common(pc, pa) == _common(pc, pb) == _common(pa, pb) == 20
        others = [p for c in (1, 8) for p in run["throughput"][c]] + run["cold"] + run["prefix"]  # type: ignore[index, operator]
        assert all(_common(p2, p) == 0 for p in others)  # P2 is fresh: no prefix in common with any other prompt
        assert p2 != run["prefix_only"][0]  # type: ignore[index]
    with pytest.raises(ValueError, match="too small"):  # one allowed id: P2 cannot start differently
        make_prompts(cfg, 3, {0, 1})


@pytest.mark.parametrize("backend", ["hyssm", "llama-server"])
def test_measure_http_against_the_fake(server: FakeServer, backend: str) -> None:
    server.reset()
    cfg = PeersConfig(model="m", runs=1, levels=(1, 4), input_len=6, output_len=5, prefix_len=12, suffix_len=3,
                      settle_quiet_s=0.05)  # fmt: skip
    run = make_prompts(cfg, VOCAB_SIZE, set())[0]
    m = asyncio.run(measure_http(server.base_url, backend, run, cfg, warmup=True))
    seen = server.state.seen
    assert len(seen) == 1 + 1 + 4 + 1 + 2 + 3  # warm-up, c=1, c=4, cold, prefix, prefix hit, shared x3
    assert [s.max_tokens for s in seen] == [2, 5, 5, 5, 5, 5, 1, 1, 1, 1, 1, 1]
    assert seen[0].prompt_ids == run["warmup"][0] and not set(seen[0].prompt_ids) & set(seen[6].prompt_ids)  # type: ignore[index]
    assert seen[6].prompt_ids == run["cold"][0] and seen[6].cached_tokens == 0  # type: ignore[index]
    assert seen[8].prompt_ids[:12] == seen[7].prompt_ids and seen[8].cached_tokens == 12
    # the shared-prefix scenario last, in order: P2+sA, P2+sB (teaching), then the measured P2+sC
    assert [s.prompt_ids for s in seen[9:]] == [*run["shared_warm"], *run["shared"]]  # type: ignore[misc]
    assert [s.cached_tokens for s in seen[9:]] == [0, 12, 12]  # fresh P2, then exactly P2 shared
    assert set(m) == {"tps_c1", "tps_c4", "decode_ms", "ttft_cold_ms", "ttft_prefix_ms", "ttft_shared_ms",
                      "settle_cold_s", "settle_prefix_s", "settle_shared_s"}  # fmt: skip
    assert all(v > 0 for v in m.values())
    assert all(m[f"settle_{k}_s"] >= 0.05 for k in ("cold", "prefix", "shared"))  # a quiet window each
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


def _builtin_tokenizer() -> dict:
    return json.loads((Path(BUILTIN) / "tokenizer.json").read_text(encoding="utf-8"))


def test_placeholder_merge_for_a_bpe_vocabulary_without_merges() -> None:
    tok = _builtin_tokenizer()
    original = json.dumps(tok)
    assert tok["model"]["type"] == "BPE" and tok["model"]["merges"] == [] and len(tok["model"]["vocab"]) == 256
    staged, what = placeholder_merge(tok)  # type: ignore[misc]
    assert json.dumps(tok) == original  # the input is not modified
    vocab, old = staged["model"]["vocab"], tok["model"]["vocab"]
    assert staged["model"]["merges"] == ["\u00fe \u00fe"]
    a, b = staged["model"]["merges"][0].split(" ")
    assert a in vocab and b in vocab and a + b in vocab  # what tokenizers (and so the converter) requires
    assert sorted(vocab.values()) == sorted(old.values()) == list(range(256))  # same ids, same size
    changed = {k: v for k, v in vocab.items() if old.get(k) != v}
    assert changed == {"\u00fe\u00fe": old["\u00ff"]} and set(old) - set(vocab) == {"\u00ff"}
    assert vocab["\u010a"] == 10  # the newline token llama.cpp looks up stays
    assert staged["added_tokens"] == tok["added_tokens"] and staged["pre_tokenizer"] == tok["pre_tokenizer"]
    assert "re-pointed token 255" in what and "llama.cpp requires" in what
    # nothing to do: merges present, or not BPE; a merged token already in the vocabulary: no re-pointing
    assert placeholder_merge({**tok, "model": {**tok["model"], "merges": ["a b"]}}) is None
    assert placeholder_merge({**tok, "model": {"type": "Unigram", "vocab": []}}) is None
    with_merged = {**tok, "model": {**tok["model"], "vocab": {**old, "\u00fe\u00fe": 256}}}
    staged2, what2 = placeholder_merge(with_merged)  # type: ignore[misc]
    assert staged2["model"]["vocab"] == with_merged["model"]["vocab"] and "re-pointed" not in what2
    not_bytes = {**tok, "model": {**tok["model"], "vocab": {"a": 0, "b": 1}}}
    with pytest.raises(PeerError, match="no byte-level token '\u00fe'"):
        placeholder_merge(not_bytes)


def test_staged_tokenizer_loads_and_tokenizes_text_as_before() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = _builtin_tokenizer()
    staged, _ = placeholder_merge(tok)  # type: ignore[misc]
    before, after = tokenizers.Tokenizer.from_str(json.dumps(tok)), tokenizers.Tokenizer.from_str(json.dumps(staged))
    text = "hello \u00fe\u00fe world\n\u00ff\u00ff caf\u00e9 \u65e5\u672c <|pad|>"
    assert after.encode(text).ids == before.encode(text).ids and len(before.encode(text).ids) > 20


FAKE_CONVERT = """#!/bin/bash
set -euo pipefail
[ "$1" = convert ] && [ "$4" = f32 ]
n=$(ls {rec} | wc -l); mkdir {rec}/$n
cp -L "$2"/tokenizer.json "$2"/config.json "$2"/model.safetensors {rec}/$n/
echo "$2" > {rec}/$n/src
echo gguf > "$3"
"""


def test_gguf_for_stages_a_copy_caches_it_and_redoes_a_stale_one(tmp_path: Path) -> None:
    model, rec, logs = tmp_path / "builtin", tmp_path / "rec", tmp_path / "logs"
    shutil.copytree(BUILTIN, model)
    rec.mkdir()
    logs.mkdir()
    script = tmp_path / "convert.sh"
    script.write_text(FAKE_CONVERT.replace("{rec}", str(rec)))
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    stale = tmp_path / "builtin.f32.gguf"
    stale.write_text("converted before staging existed")  # newer than the weights, but without a sidecar
    assert gguf_for(str(model), str(script), logs) == stale and stale.read_text() == "gguf\n"
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before  # the model directory is untouched
    got = rec / "0"
    src = Path((got / "src").read_text().strip())
    assert src.parent == logs and not src.exists()  # a staged temporary copy in the log dir, removed after
    assert json.loads((got / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"] == ["\u00fe \u00fe"]
    config = json.loads((got / "config.json").read_text())
    assert config["vocab_size"] == 264 and {**config, "vocab_size": 260} == json.loads(before["config.json"])
    with open(got / "model.safetensors", "rb") as f:
        header, base = safetensors_header(f)
        data = f.read()
    with open(model / "model.safetensors", "rb") as f:
        old_header, _ = safetensors_header(f)
        old_data = f.read()
    emb, old_emb = header["model.embed_tokens.weight"], old_header["model.embed_tokens.weight"]
    assert emb["shape"] == [264, 128] and old_emb["shape"] == [260, 128] and emb["dtype"] == old_emb["dtype"]
    start, end = emb["data_offsets"]
    o_start, o_end = old_emb["data_offsets"]
    assert data[start : start + o_end - o_start] == old_data[o_start:o_end]
    assert data[start + o_end - o_start : end] == bytes(4 * 128 * 2)  # four zero bf16 rows
    for name, info in old_header.items():  # every other tensor byte-identical
        if name not in ("__metadata__", "model.embed_tokens.weight"):
            s0, e0 = info["data_offsets"]
            s1, e1 = header[name]["data_offsets"]
            assert header[name]["shape"] == info["shape"] and data[s1:e1] == old_data[s0:e0]
    sidecar = json.loads((tmp_path / "builtin.f32.gguf.staging.json").read_text(encoding="utf-8"))
    assert len(sidecar) == 2 and "merges" in sidecar[0] and "padded model.embed_tokens.weight" in sidecar[1]
    assert gguf_for(str(model), str(script), logs) == stale and len(list(rec.iterdir())) == 1  # cached
    later = stale.stat().st_mtime + 10
    os.utime(model / "model.safetensors", (later, later))  # newer weights: converted again
    assert gguf_for(str(model), str(script), logs) == stale and len(list(rec.iterdir())) == 2


def test_dtype_line_in_the_table_and_the_json() -> None:
    results = {"hyssm": {"tps_c1": 6.0}}
    table = format_table(results, ["a note"], dtype="bfloat16")
    assert table.splitlines()[-2:] == [
        "weights: bfloat16 (hyssm --dtype / --quantization, llama.cpp's GGUF type, transformers' dtype)",
        "note: a note"]  # fmt: skip
    assert "weights:" not in format_table(results, ["a note"])
    assert json.loads(to_json(results, {}, [], {"dtype": "bfloat16"}, dtype="bfloat16"))["dtype"] == "bfloat16"


FAKE_TYPED_CONVERT = """#!/bin/bash
set -euo pipefail
[ "$1" = convert ]
echo "$4" >> {rec}
echo "gguf $4" > "$3"
"""


class _FakeTransformersProcess:
    """Stands in for ManagedProcess in run_transformers: records the job, answers in `answer_dtype`
    (None: the job's dtype)."""

    jobs: list[dict] = []
    answer_dtype: str | None = None

    def __init__(self, name: str, cmd: list[str], log_path: Path, cwd: str | None = None) -> None:
        assert name == "transformers" and cmd[1].endswith("peers_transformers.py")
        job = json.loads(Path(cmd[2]).read_text())
        self.jobs.append(job)
        runs = [{"tps_c1": 1.0} for _ in job["runs"]]
        Path(cmd[3]).write_text(json.dumps({"runs": runs, "dtype": self.answer_dtype or job["dtype"]}))
        self.peak_rss_bytes = 0

    def wait(self, timeout_s: float) -> int:
        return 0

    def stop(self) -> None:
        pass

    def log_tail(self) -> str:
        return ""


def test_dtype_reaches_every_command_and_the_gguf_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--dtype: hyssm's --dtype, llama-server's GGUF (converted to that type, cached under a name with
    the type, so both types coexist beside the model) and transformers' job; servers are not started."""
    model, rec, logs = tmp_path / "m", tmp_path / "converted", tmp_path / "logs"
    shutil.copytree(BUILTIN, model)
    logs.mkdir()
    script = tmp_path / "convert.sh"
    script.write_text(FAKE_TYPED_CONVERT.replace("{rec}", str(rec)))
    llama = tmp_path / "llama-server"
    llama.write_text("#!/bin/sh\n")
    llama.chmod(0o755)
    commands: list[tuple[str, list[str]]] = []

    def fake_run_servers(specs: list[ServerSpec], *args: object) -> tuple[dict[str, list], list[str]]:
        commands.extend((spec.name, spec.command({})) for spec in specs)
        return {spec.name: [{"tps_c1": 1.0}] for spec in specs}, []

    monkeypatch.setattr(bench_peers, "run_servers", fake_run_servers)
    monkeypatch.setattr(bench_peers, "transformers_skip_reason", lambda cfg: None)
    monkeypatch.setattr(bench_peers, "ManagedProcess", _FakeTransformersProcess)
    monkeypatch.setattr(_FakeTransformersProcess, "jobs", [])
    for dtype, typ in (("float32", "f32"), ("bfloat16", "bf16"), ("float32", "f32")):
        cfg = PeersConfig(model=str(model), runs=1, dtype=dtype, levels=(1,), input_len=4, output_len=2,
                          prefix_len=4, suffix_len=2, llama_server=str(llama), peers_script=str(script))  # fmt: skip
        commands.clear()
        medians, _, notes = benchmark(cfg, logs)
        assert set(medians) == {"hyssm", "llama.cpp", "transformers"}, notes
        cmds = dict(commands)
        hy = cmds["hyssm"]
        assert hy[hy.index("--dtype") + 1] == dtype and hy.count("--dtype") == 1
        gguf = Path(cmds["llama.cpp"][cmds["llama.cpp"].index("-m") + 1])
        assert gguf == tmp_path / f"m.{typ}.gguf" and gguf.read_text() == f"gguf {typ}\n"
        job = _FakeTransformersProcess.jobs[-1]
        assert job["dtype"] == dtype and job["settle"] == {"quiet_s": 0.5, "timeout_s": 120.0, "max_cpu": 0.25}
        assert len(job["warmup"]) == 4 and all(isinstance(t, int) for t in job["warmup"])  # one prompt of ids
    assert rec.read_text().split() == ["f32", "bf16"]  # each type converted once, then reused
    assert (tmp_path / "m.f32.gguf").is_file() and (tmp_path / "m.bf16.gguf").is_file()
    monkeypatch.setattr(_FakeTransformersProcess, "answer_dtype", "float32")
    _, _, notes = benchmark(dataclasses.replace(cfg, dtype="bfloat16"), logs)
    assert any(n.startswith("transformers: failed: transformers ran in float32, not bfloat16") for n in notes)


FAKE_QUANTIZE = """#!/bin/bash
set -euo pipefail
if [ "$1" = quantize-bin ]; then echo {quantize}; exit 0; fi
[ "$1" = convert ]
echo "$4" >> {rec}
echo "gguf $4" > "$3"
"""


def test_quantization_reaches_hyssm_and_picks_llamas_matching_file(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """--quantization int8: hyssm --quantization int8 against the converter's q8_0 file; int4: against
    llama-quantize's Q4_K_M made from the f32 file (each cached); transformers is skipped."""
    model, rec, logs = tmp_path / "m", tmp_path / "converted", tmp_path / "logs"
    shutil.copytree(BUILTIN, model)
    logs.mkdir()
    quantize = tmp_path / "llama-quantize"
    quantize.write_text('#!/bin/bash\necho "quantize $3" >> ' + str(rec) + '\necho "$3 of $(cat $1)" > "$2"\n')
    quantize.chmod(0o755)
    script = tmp_path / "peers.sh"
    script.write_text(FAKE_QUANTIZE.replace("{rec}", str(rec)).replace("{quantize}", str(quantize)))
    llama = tmp_path / "llama-server"
    llama.write_text("#!/bin/sh\n")
    llama.chmod(0o755)
    commands: dict[str, list[str]] = {}
    groups: list[list[str]] = []

    def fake_run_servers(specs: list[ServerSpec], *args: object) -> tuple[dict[str, list], list[str]]:
        commands.update((spec.name, spec.command({})) for spec in specs)
        groups.append([spec.name for spec in specs])
        return {spec.name: [{"tps_c1": 1.0}] for spec in specs}, []

    monkeypatch.setattr(bench_peers, "run_servers", fake_run_servers)
    q4 = ("int4", "m.Q4_K_M.gguf", "Q4_K_M of gguf f32\n")
    for quant, name, content in (("int8", "m.q8_0.gguf", "gguf q8_0\n"), q4, q4):
        cfg = PeersConfig(model=str(model), runs=1, quantization=quant, levels=(1,), input_len=4, output_len=2,
                          prefix_len=4, suffix_len=2, llama_server=str(llama), peers_script=str(script))  # fmt: skip
        medians, _, notes = benchmark(cfg, logs)
        assert set(medians) == {"hyssm", "llama.cpp"} and any("transformers: skipped" in n for n in notes)
        hy = commands["hyssm"]
        assert hy[hy.index("--quantization") + 1] == quant
        gguf = Path(commands["llama.cpp"][commands["llama.cpp"].index("-m") + 1])
        assert gguf == tmp_path / name and gguf.read_text() == content
    assert rec.read_text().split("\n")[:-1] == ["q8_0", "f32", "quantize Q4_K_M"]  # each made once
    assert groups == [["hyssm", "llama.cpp"]] * 3  # both servers up together, their runs alternating
    groups.clear()
    benchmark(dataclasses.replace(cfg, sequential=True), logs)
    assert groups == [["hyssm"], ["llama.cpp"]]
    with pytest.raises(ValueError, match="quantization must be one of"):
        PeersConfig(model=str(model), quantization="int3")


def test_transformers_loads_the_model_in_the_jobs_dtype() -> None:
    pytest.importorskip("transformers")
    from benchmarks.peers_transformers import run_job

    prompt = [3, 4, 5, 6, 7, 8]
    run = {"throughput": {"1": [prompt]}, "cold": [prompt], "prefix": [prompt], "shared": [prompt]}
    job = {"model": BUILTIN, "dtype": "bfloat16", "threads": 1, "output_len": 3, "runs": [run], "warmup": [9] * 6,
           "settle": {"quiet_s": 0.05}}  # fmt: skip
    out = run_job(job)
    assert out["dtype"] == "bfloat16" and out["runs"][0]["tps_c1"] > 0
    assert all(out["runs"][0][f"settle_{k}_s"] >= 0.05 for k in ("cold", "prefix", "shared"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        run_job({**job, "dtype": "float16"})


@pytest.mark.parametrize(("input_len", "prefix_len", "levels", "want"), [
    (4096, 512, (1,), 5 * 1024),  # a long cold prompt decides the slot size
    (128, 512, (1, 8), 8 * 1024),  # the continuation prompt does
    (16384, 512, (1, 2), 2 * 17 * 1024),
])
def test_llama_context_holds_the_longest_prompt_of_every_slot(input_len: int, prefix_len: int,
                                                              levels: tuple[int, ...], want: int) -> None:
    from benchmarks.peers_commands import llama_command

    cfg = PeersConfig(model="m", levels=levels, input_len=input_len, output_len=32, prefix_len=prefix_len,
                      suffix_len=32)  # fmt: skip
    cmd = llama_command(cfg, "llama-server", Path("m.gguf"), 1234)
    assert int(cmd[cmd.index("-c") + 1]) == want
    assert int(cmd[cmd.index("--parallel") + 1]) == max(levels)


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
