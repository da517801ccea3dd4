"""bench_peers' settle period and memory-comparable llama-server context: the wait before a measured TTFT
follows the server's reported load and its processes' CPU use (bounded), the cold prompt goes out only
after a lingering server went quiet, transformers waits for its own process likewise, llama-server's -c
follows hyssm's reported KV pool (or the flag), and the report states both configurations."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.bench_peers import PeersConfig, ServerSpec, _llama_spec, measure_http, parse_args, run_servers
from benchmarks.peers_commands import hyssm_config_line, llama_context
from benchmarks.peers_procs import PeerError, free_port, tree_cpu_seconds
from benchmarks.peers_prompts import make_prompts
from benchmarks.peers_report import format_table, to_json
from benchmarks.peers_settle import SettleConfig, busy_requests, settle
from benchmarks.peers_transformers import settle as settle_process
from tests.bench.fake_server import VOCAB_SIZE, FakeServer
from tests.bench.test_peers import BUILTIN, CHILD

pytestmark = pytest.mark.timeout(120)
SPIN = "while True: pass"


async def _settle(base_url: str, pid: int | None, sc: SettleConfig) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=base_url) as client:
        return await settle(client, pid, sc, "test")


@pytest.mark.parametrize("backend", ["hyssm", "llama-server"])
def test_the_cold_prompt_waits_until_a_lingering_server_is_quiet(server: FakeServer, backend: str) -> None:
    """A server still busy after the concurrency wave's last response (as llama-server after c=32): the
    cold prompt goes out only after it reported idle for the whole quiet window."""
    linger, quiet = 0.4, 0.15
    server.reset(linger_s=linger)
    cfg = PeersConfig(model="m", runs=1, levels=(1, 4), input_len=6, output_len=3, prefix_len=8, suffix_len=2,
                      settle_quiet_s=quiet)  # fmt: skip
    m = asyncio.run(measure_http(server.base_url, backend, make_prompts(cfg, VOCAB_SIZE, set())[0], cfg, True))
    seen, ended = server.state.seen, server.state.ended
    cold = seen[6]  # after the warm-up, the c=1 and the four c=4 requests
    assert cold.max_tokens == 1 and len(ended) >= 6
    assert cold.arrived - max(ended[:6]) >= linger + quiet - 0.01
    assert m["settle_cold_s"] >= linger + quiet - 0.01 and m["settle_shared_s"] >= linger + quiet - 0.01


def test_settle_is_bounded_and_says_what_it_saw(server: FakeServer) -> None:
    server.reset(linger_s=60.0)
    server.state.last_end = time.monotonic()  # busy from now on
    with pytest.raises(PeerError, match=r"test: the server did not settle within 0s \(1 request\(s\) running"):
        asyncio.run(_settle(server.base_url, None, SettleConfig(quiet_s=0.05, timeout_s=0.3)))
    server.reset()
    got = asyncio.run(_settle(server.base_url, None, SettleConfig(quiet_s=0.1)))
    assert 0.1 <= got["settle_s"] < 5 and got["settle_cpu_cores"] == 0.0


def test_settle_watches_the_process_tree_cpu(tmp_path: Path) -> None:
    """A server reporting no load endpoint: its processes' CPU use decides; a busy one never settles
    (bounded), an idle one does; with neither a load nor a pid there is nothing to observe."""
    port = free_port()
    quiet_server = subprocess.Popen([sys.executable, "-c", CHILD, str(port)], start_new_session=True)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the child answers (readiness poll)
            try:
                httpx.get(f"{url}/health")
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert asyncio.run(_busy(url)) is None  # 404 on /metrics and /slots
        with pytest.raises(PeerError, match="reports no load"):
            asyncio.run(_settle(url, None, SettleConfig()))
        t0 = tree_cpu_seconds(spinner.pid)
        with pytest.raises(PeerError, match=r"did not settle within 1s \(no request, but its processes used"):
            asyncio.run(_settle(url, spinner.pid, SettleConfig(quiet_s=0.2, timeout_s=1.0, max_cpu=0.3)))
        assert tree_cpu_seconds(spinner.pid) - t0 > 0.3  # it did spin meanwhile
        got = asyncio.run(_settle(url, quiet_server.pid, SettleConfig(quiet_s=0.2, max_cpu=0.3)))
        assert got["settle_cpu_cores"] <= 0.3
    finally:
        for proc in (quiet_server, spinner):
            os.killpg(proc.pid, signal.SIGKILL)  # the group each was started in (CHILD's grandchild too)
            proc.wait()


async def _busy(url: str) -> float | None:
    async with httpx.AsyncClient(base_url=url) as client:
        return await busy_requests(client)


def test_transformers_waits_for_its_own_process_to_go_quiet() -> None:
    ticks = iter([0.0, 0.5, 1.0, 1.5, 2.0])  # CPU seconds: busy for the first calls, then flat

    def clock() -> float:
        return next(ticks, 2.0)

    waited = settle_process(quiet_s=0.1, max_cpu=0.5, cpu_clock=clock)
    assert waited >= 0.2  # the busy windows started afresh
    with pytest.raises(RuntimeError, match="did not go quiet"):
        settle_process(quiet_s=0.05, timeout_s=0.3, max_cpu=0.5, cpu_clock=lambda: time.monotonic() * 10)


def test_llama_context_follows_hyssms_pool_or_the_flag() -> None:
    cfg = PeersConfig(model="m", levels=(1, 8), input_len=128, output_len=32, prefix_len=512, suffix_len=32)
    assert llama_context(cfg, 131071) == (131071, "hyssm's KV pool")
    ctx, how = llama_context(cfg, 2000)  # 250 per slot: the continuation prompt (576) would not fit
    assert ctx == 8 * 576 and how == "hyssm's KV pool, raised from 2000 so that each of the 8 slots holds 576 tokens"
    assert llama_context(cfg, None)[0] == 8 * 1024 and "is unknown" in llama_context(cfg, None)[1]
    assert llama_context(PeersConfig(model="m", levels=(1, 8), llama_ctx="workload"), 131071)[0] == 8 * 1024
    assert llama_context(PeersConfig(model="m", levels=(1, 2), llama_ctx="20000"), 131071) == (20000, "--llama-ctx")
    with pytest.raises(ValueError, match="--llama-ctx must be"):
        PeersConfig(model="m", llama_ctx="0")
    for flags in (["--llama-ctx", "big"], ["--settle-quiet", "-1"], ["--settle-timeout", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--model", BUILTIN, *flags])
    assert parse_args(["--model", BUILTIN]).llama_ctx == "hyssm"


def test_llamas_command_is_made_from_hyssms_reported_pools() -> None:
    cfg = PeersConfig(model="m", levels=(1, 4), input_len=16, output_len=4, prefix_len=32, suffix_len=4)
    configs: dict[str, str] = {}
    spec = _llama_spec(cfg, "llama-server", Path("m.f32.gguf"), 1234, configs)
    cmd = spec.command({"hyssm": {"kv_tokens": 6000, "state_slots": 90}})
    assert cmd[cmd.index("-c") + 1] == "6000" and cmd[cmd.index("--parallel") + 1] == "4" and "--metrics" in cmd
    assert configs["llama.cpp"].startswith("llama.cpp: llama-server f32 GGUF --parallel 4 -c 6000 (hyssm's KV pool): "
                                           "1500 KV tokens per slot, one recurrent state per slot (4)")  # fmt: skip
    line = hyssm_config_line(cfg, {"kv_tokens": 6000, "state_slots": 90})
    assert line.startswith("hyssm: launch.py --model-path m --dtype float32 --max-running-requests 64")
    assert "KV pool 6000 token slots" in line and "90 recurrent-state slots" in line and "--port" not in line
    table = format_table({"hyssm": {"tps_c1": 1.0}}, ["a note"], configs={**configs, "hyssm": line})
    assert table.splitlines()[-3:] == [f"config: {line}", f"config: {configs['llama.cpp']}", "note: a note"]
    assert '"configs": {' in to_json({}, {}, [], {}, configs={"hyssm": line})


METRICS_CHILD = CHILD.replace(
    'self.send_response(200 if self.path == "/health" else 404); self.end_headers()',
    'ok = self.path in ("/health", "/metrics"); self.send_response(200 if ok else 404); self.end_headers(); '
    'self.wfile.write(b"hyssm_kv_slots_capacity 4096.0\\nhyssm_mamba_slots_capacity 40.0\\n" if ok else b"")')


def test_a_later_server_is_made_from_the_first_ones_pools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_servers starts the servers in turn and reads a hyssm server's pools once it is ready, so the
    next server's command (llama-server's -c) is made from them."""
    import benchmarks.bench_peers as bench_peers

    ports = [free_port(), free_port()]
    given: list[dict] = []

    def second(pools: dict) -> list[str]:
        given.append(dict(pools))
        return [sys.executable, "-c", CHILD, str(ports[1])]

    async def fake_measure(*args: object, **kw: object) -> dict:
        return {"tps_c1": 1.0}

    monkeypatch.setattr(bench_peers, "measure_http", fake_measure)
    specs = [ServerSpec("hyssm", [sys.executable, "-c", METRICS_CHILD, str(ports[0])], ports[0], "hyssm"),
             ServerSpec("llama.cpp", second, ports[1], "llama-server")]  # fmt: skip
    pools: dict = {}
    out, notes = run_servers(specs, [{}], PeersConfig(model="m", ready_timeout_s=30), tmp_path, pools)
    assert not notes and set(out) == {"hyssm", "llama.cpp"}
    assert given == [{"hyssm": {"kv_tokens": 4096, "state_slots": 40}}] and pools == given[0]
