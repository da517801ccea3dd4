"""soak.py: the plateau/growth verdict and /proc parsing (pure), and two tiny waves of the mixed
traffic against the built-in model, whose report must hold a sample of every server process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.soak import main, slope, verdict
from benchmarks.soak_procs import classify, parse_status, sample_server
from benchmarks.soak_traffic import MIX, draw_request, prefix_texts
from tests.e2e.server import running_server


def _waves(rss: list[float], fds: list[int] | None = None) -> list[dict[str, object]]:
    fds = fds or [10] * len(rss)
    return [{"processes": [{"name": "worker-tp0", "kind": "worker", "rss_mb": r, "fds": f}]}
            for r, f in zip(rss, fds, strict=True)]  # fmt: skip


def test_slope_is_least_squares() -> None:
    assert slope([5.0, 7.0, 9.0, 11.0]) == pytest.approx(2.0)
    assert slope([1.0, 3.0, 2.0]) == pytest.approx(0.5)
    assert slope([4.0]) == 0.0


def test_verdict_uses_the_last_half_of_the_waves() -> None:
    filling = verdict(_waves([250, 400, 500, 560, 561, 561, 562, 561]), 2.0, 0.5)  # fills, then flat
    assert filling["overall"] == "plateau"
    w = filling["processes"]["worker-tp0"]
    assert w["window_waves"] == 4 and w["first_rss_mb"] == 250 and w["last_rss_mb"] == 561
    assert abs(w["slope_mb_per_wave"]) < 1
    assert verdict(_waves([250, 260, 270, 280, 290, 300]), 2.0, 0.5)["overall"] == "growth"
    leaking_fds = verdict(_waves([300.0] * 6, fds=[10, 11, 12, 13, 14, 15]), 2.0, 0.5)
    assert leaking_fds["processes"]["worker-tp0"]["verdict"] == "growth"
    assert verdict(_waves([300.0, 310.0, 320.0, 330.0]), 2.0, 0.5)["overall"] == "insufficient"  # 2 points


def test_proc_status_and_titles() -> None:
    text = "Name:\tx\nVmRSS:\t  2048 kB\nRssAnon:\t  1024 kB\nRssFile:\t 512 kB\nRssShmem:\t 512 kB\n"
    assert parse_status(text) == {"rss_mb": 2.0, "rss_anon_mb": 1.0, "rss_file_mb": 0.5, "rss_shmem_mb": 0.5}
    assert parse_status("Name:\tzombie\n")["rss_mb"] == 0.0
    assert classify(10, 10, "python launch.py") == ("launcher", "launcher")
    assert classify(11, 10, "hyssm::worker-dp1-tp0") == ("worker", "worker-dp1-tp0")
    assert classify(12, 10, "hyssm::scheduler") == ("scheduler", "scheduler")
    assert classify(13, 10, "python -c from multiprocessing.resource_tracker import main") == ("other", "other-13")
    (me,) = sample_server(os.getpid())[:1]
    assert me.kind == "launcher" and me.rss_mb > 0 and me.fds > 0


def test_traffic_mix_is_seeded_and_covers_every_kind() -> None:
    import random

    prefixes = prefix_texts(0)
    assert draw_request(random.Random(1), "m", prefixes) == draw_request(random.Random(1), "m", prefixes)
    rng = random.Random(2)
    reqs = [draw_request(rng, "m", prefixes) for _ in range(300)]
    assert {r.kind for r in reqs} == set(MIX)
    for r in reqs:
        if r.kind == "cut":
            assert r.body["stream"] is True and r.cut_after is not None
        if r.kind == "json":
            assert r.body["response_format"]["type"] == "json_schema"  # type: ignore[index]
        if r.kind == "prefix":
            assert r.body["messages"][0]["content"] in prefixes  # type: ignore[index]


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_two_tiny_waves_sample_every_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    with running_server(["--model-path", "builtin"]) as server:
        flags = ["--url", server.url, "--pid", str(server.proc.pid), "--minutes", "30", "--max-waves", "2",
                 "--wave-requests", "12", "--concurrency", "6", "--seed", "3", "--out", str(out)]  # fmt: skip
        assert main(flags) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    waves = report["waves"]
    assert [w["wave"] for w in waves] == [0, 1, 2]
    assert [line.split()[1] for line in printed.splitlines() if line.startswith("wave")] == ["0", "1", "2"]
    for w in waves[1:]:
        counts = w["outcomes"]
        assert sum(c["ok"] + c["cut"] + c["failed"] for c in counts.values()) == 12
        assert sum(c["failed"] for c in counts.values()) == 0, w["errors"]
    for w in waves:
        kinds = {p["kind"] for p in w["processes"]}
        assert {"launcher", "tokenizer", "scheduler", "worker"} <= kinds, kinds
        for p in w["processes"]:
            assert p["rss_mb"] > 0 and p["fds"] > 0
            assert p["rss_mb"] == pytest.approx(p["rss_anon_mb"] + p["rss_file_mb"] + p["rss_shmem_mb"], abs=0.01)
    assert {p["pid"] for p in waves[0]["processes"] if p["kind"] == "launcher"} == {server.proc.pid}
    result = report["verdict"]
    assert result["threshold_mb_per_wave"] == 2.0 and result["overall"] == "insufficient"  # 2 waves: too few
    assert {v["kind"] for v in result["processes"].values()} >= {"tokenizer", "scheduler", "worker"}
    assert "verdict: insufficient" in printed
