"""Tensor-parallel serving through a real launch.py (issue 6 acceptance): `--tp-size 2` on one
node, and TP=2 split over two launch.py processes (`--nnodes 2`, node-rank 0 and 1) on loopback,
each serving the greedy outputs of the single-rank runtime; start-up errors of TP launches."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from shared.config import builtin_model_dir
from tests.e2e.server import DETERMINISTIC, ROOT, Server, free_port, group_pids, running_server
from tests.worker.util import edit_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


Case = tuple[list[int], int, list[int]]


@pytest.fixture(scope="module")
def runner() -> Any:
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    return ModelRunner(
        builtin_model_dir(),
        WorkerConfig(device="cpu", dtype="float32", kv_slots=512, state_slots=4, deterministic=True),
    )


def _cases(runner: Any, prompts: list[list[int]], rng: random.Random) -> list[Case]:
    """(prompt, max_new_tokens, greedy output of the TP=1 runtime alone) per prompt."""
    from tests.model_driver import generate_greedy

    cases = []
    for prompt in prompts:
        n = rng.randint(1, 10)
        cases.append((prompt, n, generate_greedy(runner, prompt, n)))
    return cases


@pytest.fixture(scope="module")
def expected(runner: Any) -> list[Case]:
    rng = random.Random(11)
    return _cases(runner, [[rng.randrange(256) for _ in range(rng.randint(2, 70))] for _ in range(10)], rng)


def _serves_expected(server: Server, expected: list[Case]) -> None:
    def one(case: Case) -> list[int]:
        prompt, n, _ = case
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        with server.client() as client:
            r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with cf.ThreadPoolExecutor(len(expected)) as pool:
        outputs = list(pool.map(one, expected))
    assert outputs == [want for _, _, want in expected]


def test_tp2_serves_the_single_rank_outputs(expected: list[Case]) -> None:
    with running_server(["--tp-size", "2", "--max-running-requests", "8", *DETERMINISTIC]) as server:
        _serves_expected(server, expected)
        assert "rank1_device" in server.output or "rank 1 ready" in server.output


@pytest.mark.parametrize("name", ["nemotron_h_moe", "falcon_h1", "mamba2", "qwen3_next_moe"])
def test_tp2_serves_other_families(tmp_path, name: str) -> None:
    """Nemotron-H MoE, Falcon-H1, the attention-free Mamba2 and the Gated DeltaNet Qwen3-Next MoE
    under --tp-size 2 serve the greedy outputs of the single-rank runtime (the parity fixtures
    with the built-in tokenizer files)."""
    from tests.e2e.test_families import model_dir
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    path = model_dir(tmp_path, name)
    ref = ModelRunner(
        path, WorkerConfig(device="cpu", dtype="float32", kv_slots=512, state_slots=4, deterministic=True)
    )
    rng = random.Random(12)
    cases = _cases(ref, [[rng.randrange(3, 256) for _ in range(rng.randint(2, 40))] for _ in range(6)], rng)
    args = ["--model-path", path, "--tp-size", "2", "--max-running-requests", "8", "--dtype", "float32", *DETERMINISTIC]
    with running_server(args) as server:
        _serves_expected(server, cases)


@pytest.mark.parametrize("name", ["builtin", "qwen3_next_moe"])
def test_tp2_with_drafts_serves_the_single_rank_outputs(tmp_path, runner: Any, name: str) -> None:
    """NGRAM speculation under --tp-size 2: rank 0 decides what each verify step accepts and both
    ranks leave their state shards after exactly those tokens (the Mamba and the Gated DeltaNet
    hybrid), so outputs are the single-rank runtime's, with drafts accepted and rejected."""
    from tests.e2e.test_families import model_dir
    from tests.model_driver import generate_greedy
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    path = builtin_model_dir() if name == "builtin" else model_dir(tmp_path, name)
    ref = (
        runner
        if name == "builtin"
        else ModelRunner(
            path, WorkerConfig(device="cpu", dtype="float32", kv_slots=512, state_slots=4, deterministic=True)
        )
    )
    rng = random.Random(13)
    cases: list[Case] = []
    for _ in range(4):
        seed = [rng.randrange(3, 256) for _ in range(5)]
        prompt = seed + generate_greedy(ref, seed, 20) + seed  # its continuation repeats the prompt
        cases.append((prompt, 16, generate_greedy(ref, prompt, 16)))
    args = ["--model-path", path, "--tp-size", "2", "--max-running-requests", "8", "--dtype", "float32",
            "--speculative-algorithm", "NGRAM", *DETERMINISTIC]  # fmt: skip
    with running_server(args) as server:
        _serves_expected(server, cases)
        assert server.metric("hyssm_spec_verify_steps_total") > 0
        if name == "builtin":
            assert server.metric("hyssm_spec_accepted_tokens_total") > 0


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_tp2_nextn_drafts_with_sharded_mtp_layers(tmp_path, family: str) -> None:
    """NEXTN under --tp-size 2: each rank holds its heads and experts of the MTP layer and its MTP KV
    shard, both run it on rank 0's sampled tokens, and outputs are the single-rank runtime's."""
    from tests.e2e.test_speculative import _mtp_model
    from tests.model_driver import generate_greedy
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    path = _mtp_model(tmp_path, family)
    ref = ModelRunner(
        path, WorkerConfig(device="cpu", dtype="float32", kv_slots=512, state_slots=4, deterministic=True)
    )
    rng = random.Random(14)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(66, 80))] for _ in range(3)]
    cases: list[Case] = [(p, 12, generate_greedy(ref, p, 12)) for p in prompts]
    args = ["--model-path", path, "--tp-size", "2", "--max-running-requests", "8", "--dtype", "float32",
            "--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "2", *DETERMINISTIC]  # fmt: skip
    with running_server(args) as server:
        _serves_expected(server, cases)
        assert server.metric("hyssm_spec_verify_steps_total") > 0


def test_tp2_copy_on_write_refusals_are_agreed_by_both_ranks(runner: Any) -> None:
    """Each rank refuses copy-on-writes at random on its own (different per rank); the ranks
    agree on the union before the forward pass, so their states never diverge and every request
    still gets the single-rank output."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(256) for _ in range(40)] for _ in range(2)]
    warm = _cases(runner, prefixes, rng)
    shared = _cases(
        runner, [prefixes[i % 2] + [rng.randrange(256) for _ in range(rng.randint(1, 9))] for i in range(12)], rng
    )
    args = ["--tp-size", "2", "--max-running-requests", "8", "--fault-refuse-cow-fraction", "0.4", *DETERMINISTIC]
    with running_server(args) as server:
        _serves_expected(server, warm)  # the prefixes' states go into the cache
        _serves_expected(server, shared)  # hits: copy-on-write of the cached state
        assert server.metric("hyssm_admission_refusals_total", reason="worker_refusal") > 0


def _port_block() -> int:
    """A port P with P (rendezvous), P+1 (worker -> scheduler), P+10, P+11 (scheduler -> ranks) free."""
    for _ in range(50):
        base = free_port()
        if base + 11 > 65535:
            continue
        try:
            socks = []
            for offset in (1, 10, 11):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def test_two_nodes_on_loopback(expected: list[Case]) -> None:
    common = ["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", f"127.0.0.1:{_port_block()}", *DETERMINISTIC]
    node1 = Server([*common, "--node-rank", "1"])  # started first: it waits for node 0
    try:
        with running_server([*common, "--node-rank", "0", "--max-running-requests", "8"]) as node0:
            _serves_expected(node0, expected)
            deadline = time.monotonic() + 10
            while "node 1 workers ready" not in node1.output and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "node 1 workers ready" in node1.output, node1.output[-2000:]
            assert node1.proc.poll() is None
        # node 0 stopped gracefully: its scheduler told every rank to shut down, node 1 follows at once
        assert node1.wait_exit(15) == 0, node1.output[-2000:]
    finally:
        node1.stop()
    assert group_pids(node1.pgid) == []


def _launch(args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [sys.executable, "launch.py", "--device", "cpu", "--port", str(free_port()), *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launch's own process group, nothing else
        except ProcessLookupError:
            pass
        proc.wait(10)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - t0


def _one_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_unreachable_dist_init_addr_fails_after_the_startup_timeout() -> None:
    addr = f"127.0.0.1:{free_port()}"  # nobody listens there: node 0 never comes
    res, elapsed = _launch(
        ["--nnodes", "2", "--node-rank", "1", "--tp-size", "2", "--dist-init-addr", addr, "--startup-timeout", "2"]
    )
    line = _one_line(res)
    assert addr in line and "--dist-init-addr" in line
    assert 2.0 <= elapsed < 30


@pytest.mark.parametrize(
    ("changes", "tp", "needle"),
    [
        ({}, 3, "num_attention_heads 4"),
        ({"num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 16}, 4, "num_key_value_heads 6"),
        ({"mamba_n_heads": 2, "mamba_d_head": 128}, 4, "mamba_n_heads 2"),
    ],
)
def test_head_counts_not_divisible_fail_before_spawning(tmp_path, changes: dict, tp: int, needle: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(builtin_model_dir(), model)
    edit_config(str(model), **changes)
    res, elapsed = _launch(["--model-path", str(model), "--tp-size", str(tp)])
    line = _one_line(res)
    assert f"--tp-size {tp}" in line and needle in line
    assert elapsed < 10


def test_more_ranks_than_gpus_fails_before_spawning() -> None:
    res, _ = _launch(["--device", "cuda", "--tp-size", "2", "--base-gpu-id", "4096"])
    line = _one_line(res)
    assert "--tp-size 2" in line and "GPUs" in line
