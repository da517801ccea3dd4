"""Every benchmark script (``benchmarks/bench_*.py`` and ``benchmarks/soak.py``) runs as
``python -m benchmarks.<name>`` in a subprocess, as users start them: ``--help`` exits 0 with its usage,
and a tiny run of each (its cheapest mode: the built-in model, the fake server of fake_server.py, CPU
shapes; no llama.cpp, no big checkpoint) exits 0 with the line of its report named in `TINY`. Runs that
need something outside the repository (a llama-server binary, a CUDA GPU) are in `EXTERNAL` and are
skipped, saying why, where it is missing. The figures themselves are checked by each script's own test."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.peers_commands import DEFAULT_PEERS_SCRIPT, default_llama_server
from tests.bench.fake_server import FakeServer

REPO = Path(__file__).resolve().parents[2]
BUILTIN = str(REPO / "worker_proc" / "builtin_model")
SCRIPTS = sorted(p.stem for p in (REPO / "benchmarks").glob("bench_*.py")) + ["soak"]

Args = Callable[[Path, str], list[str]]  # (a temporary folder, the fake server's URL) -> argv


@dataclass(frozen=True)
class Tiny:
    """A script's tiny run: its arguments, a regex its stdout must match (multiline), the files it must
    write (relative to the temporary folder), and whether it starts hyssm servers (e2e, slower)."""

    args: Args
    expect: str
    writes: tuple[str, ...] = ()
    servers: bool = False
    timeout_s: float = 150.0


def _peers_json(tmp: Path, url: str) -> list[str]:
    medians = {"hyssm": {"tps_c1": 5.0, "ttft_cold_ms": 40.0, "peak_rss_mib": 300.0},
               "llama.cpp": {"tps_c1": 6.0, "ttft_cold_ms": 50.0, "peak_rss_mib": 200.0}}  # fmt: skip
    (tmp / "peers.json").write_text(json.dumps({"medians": medians}))
    return ["--peers", str(tmp / "peers.json"), "-o", str(tmp / "peers.png")]


def _sweep_json(tmp: Path, url: str) -> list[str]:
    point = {"load": 1, "completed": 4, "failed": 0, "output_token_throughput": 12.5,
             "ttft_ms": {"median": 30.0, "p99": 41.0}, "itl_ms": {"median": 5.0, "p99": 7.5}}  # fmt: skip
    doc = {"sweep": "concurrency", "levels": [1], "targets": [{"label": "fake", "backend": "hyssm",
                                                               "base_url": url, "points": [point]}]}  # fmt: skip
    (tmp / "sweep.json").write_text(json.dumps(doc))
    return [str(tmp / "sweep.json")]


TINY: dict[str, Tiny] = {
    "bench_cpu_attention": Tiny(lambda t, u: ["--dtype", "float32", "--contexts", "0,100", "--chunk", "40", "--runs",
                                              "1"], r"^\| decode over 40 \|"),  # fmt: skip
    "bench_kda": Tiny(lambda t, u: ["--shapes", "2x8", "--decode-rows", "2", "--prefill-tokens", "16", "--reps", "1"],
                      r"^prefill heads  2 d   8 rows   16: reference +[\d.]+ native +[\d.]+ ms$"),
    "bench_images": Tiny(lambda t, u: ["--shape", "tiny", "--model-dir", str(t / "vision"), "--image-side", "64",
                                       "--runs", "1", "--concurrency", "1", "--images", "1", "--max-tokens", "2",
                                       "--log-dir", str(t / "logs"), "--out", str(t / "images.json")],
                         r"^\| 1 \| 1 \| [\d.]+ \| [\d.]+ \|", ("images.json",), servers=True),  # fmt: skip
    "bench_kernels": Tiny(lambda t, u: ["--cpu-reference", "--iters", "2"],
                          r"^cpu\s+attn_prefill L=40\+9 prefix=0\s+reference"),
    "bench_kernels_cases": Tiny(lambda t, u: ["--preset", "cpu-tiny"], r"^\d+ cases \(cpu-tiny, cpu, float32\)$"),
    "bench_lora": Tiny(lambda t, u: ["--shape", "builtin", "--rank", "4", "--concurrency", "2", "--adapters", "0,1",
                                     "--runs", "1", "--input-len", "8", "--output-len", "2", "--log-dir",
                                     str(t / "logs"), "--out", str(t / "lora.json")],
                       r"^\| 2 \| 1 \| [\d.]+ \| [\d.]+ \|$", ("lora.json",), servers=True),  # fmt: skip
    "bench_long_prompt_memory": Tiny(lambda t, u: ["--model", BUILTIN, "--skip-llama", "--runs", "1",
                                                   "--prompt-tokens", "64", "--output-tokens", "2",
                                                   "--output-json", str(t / "memory.json")],
                                     r"^hyssm\s+\d+\s+\d+\s+[\d.]+$", ("memory.json",), servers=True),
    "bench_model_shapes": Tiny(lambda t, u: ["--shape", "granite-4.0-h-350m", "--num-layers", "2", "--tensors"],
                               r"^granite-4.0-h-350m: [\d.]+M parameters, 2 layers \(1 attention, 1 mamba\)$"),
    "bench_peers": Tiny(lambda t, u: ["--model", BUILTIN, "--runs", "1", "--levels", "1", "--input-len", "8",
                                      "--output-len", "2", "--prefix-len", "16", "--suffix-len", "4", "--skip-llama",
                                      "--skip-transformers", "--settle-quiet", "0.1", "--log-dir", str(t / "logs"),
                                      "--output-json", str(t / "peers.json")],
                        r"^config: hyssm: launch\.py .*KV pool \d+ token slots", ("peers.json",), servers=True),
    "bench_plots": Tiny(_peers_json, r"^wrote .*peers\.png$", ("peers.png",)),
    "bench_products": Tiny(lambda t, u: ["--shapes", "64x64", "--storage", "int8", "--rows", "2", "--threads", "1",
                                         "--stream-mb", "1"], r"^64x64 \| \w+ \| 2 \|"),  # fmt: skip
    "bench_quality": Tiny(lambda t, u: ["--small", "--modes", "state:int8", "--roundtrip-tokens", "64", "--window",
                                        "32", "--threads", "1", "--output-json", str(t / "q.json")],
                          r"^int8: 1 resumes; first divergence", ("q.json",)),  # fmt: skip
    "bench_scheduler": Tiny(lambda t, u: ["--queued", "40", "--prefix", "64", "--rounds", "30", "--limits", "state"],
                            r"^worst round with capacity exhausted: [\d.]+ µs"),
    "bench_serving": Tiny(lambda t, u: ["--base-url", u, "--num-prompts", "4", "--input-len", "8", "--output-len",
                                        "3", "--disable-tqdm"], r"^Successful requests:\s+4$"),  # fmt: skip
    "bench_speculative": Tiny(lambda t, u: ["--model", BUILTIN, "--runs", "1", "--levels", "1", "--input-len", "16",
                                            "--output-len", "4", "--seed-len", "4", "--skip-llama", "--log-dir",
                                            str(t / "logs")], r"^\| repeat \| 1 \|", servers=True),  # fmt: skip
    "bench_state_cache": Tiny(lambda t, u: ["--shape", "builtin", "--parts", "ttft", "--lengths", "64", "--repeats",
                                            "1", "--block-tokens", "16", "--log-dir", str(t / "logs"), "--out",
                                            str(t / "sc.json"), "--log-level", "WARNING"],
                              r"^\| 64 \| cold ", ("sc.json",), servers=True, timeout_s=240),  # fmt: skip
    "bench_state_drift": Tiny(lambda t, u: ["--tokens", "8", "--window", "4", "--threads", "1", "--dtypes",
                                            "bfloat16"], r"^\S+: 8 greedy tokens after a \d+-token"),  # fmt: skip
    "bench_step": Tiny(lambda t, u: ["--threads", "1", "--batches", "1", "--prompt-len", "8", "--decode-steps", "2",
                                     "--runs", "1"], r"^one-row step floor"),  # fmt: skip
    "bench_sweep": Tiny(_sweep_json, r"^fake\s+1\s+12\.5\s+30\.0\s+41\.0\s+5\.00\s+7\.50\s+0$"),
    "bench_tokenizer": Tiny(lambda t, u: [str(t / "tok"), "--vocab-size", "512"], r": 512 ids, eos \d+, pad \d+$",
                            ("tok/tokenizer.json", "tok/tokenizer_config.json")),
    "soak": Tiny(lambda t, u: ["--model-path", "builtin", "--minutes", "1", "--max-waves", "1", "--wave-requests", "4",
                               "--concurrency", "2", "--out", str(t / "soak.json"), "--log-level", "WARNING"],
                 r"^verdict: insufficient", ("soak.json",), servers=True),  # fmt: skip
}


def _llama_missing() -> str | None:
    binary = default_llama_server(str(DEFAULT_PEERS_SCRIPT))
    if binary is None or not os.access(binary, os.X_OK):
        return f"needs llama.cpp's llama-server (none at {binary}; `bash {DEFAULT_PEERS_SCRIPT} build` makes it)"
    return None


def _gpu_missing() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA GPU (the Triton kernels)"


EXTERNAL: dict[str, tuple[str, Callable[[], str | None], Tiny]] = {
    "bench_peers with llama.cpp": ("bench_peers", _llama_missing, Tiny(
        lambda t, u: ["--model", BUILTIN, "--runs", "1", "--levels", "1", "--input-len", "8", "--output-len", "2",
                      "--prefix-len", "16", "--suffix-len", "4", "--skip-transformers", "--settle-quiet", "0.1",
                      "--log-dir", str(t / "logs")],
        r"^config: llama\.cpp: llama-server f32 GGUF --parallel 1 -c \d+ ", servers=True, timeout_s=280)),
    "bench_kernels on a GPU": ("bench_kernels", _gpu_missing, Tiny(
        lambda t, u: ["--device", "cuda", "--quick", "--preset", "tiny", "--iters", "3", "--filter", "decode"],
        r"decode")),
}  # fmt: skip


def _run(name: str, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s)  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", SCRIPTS)
def test_help_prints_the_usage(name: str) -> None:
    proc = _run(name, ["--help"], 90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0] if proc.stdout else ""
    assert first.startswith(f"usage: {name}.py ") and "options:" in proc.stdout, proc.stdout[:500]


def test_every_script_has_a_tiny_run() -> None:
    assert set(TINY) == set(SCRIPTS), "give a new benchmark script a tiny run in TINY"
    assert {script for script, _, _ in EXTERNAL.values()} <= set(SCRIPTS)


def _check(name: str, tiny: Tiny, tmp: Path, url: str) -> None:
    proc = _run(name, tiny.args(tmp, url), tiny.timeout_s)
    tail = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, tail
    assert re.search(tiny.expect, proc.stdout, re.M), tail
    for rel in tiny.writes:
        assert (tmp / rel).is_file() and (tmp / rel).stat().st_size > 0, f"{rel} not written\n{tail}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.e2e, pytest.mark.slow]) if TINY[n].servers
                                  else n for n in sorted(TINY)])  # fmt: skip
def test_tiny_run(name: str, tmp_path: Path, server: FakeServer) -> None:
    if name == "bench_plots" and importlib.util.find_spec("matplotlib") is None:
        pytest.skip("needs matplotlib (pip install 'hyssm[bench]')")
    server.reset()
    _check(name, TINY[name], tmp_path, server.base_url)
    if name == "bench_plots":
        assert (tmp_path / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(EXTERNAL))
def test_tiny_run_with_an_external_peer(case: str, tmp_path: Path, server: FakeServer) -> None:
    name, missing, tiny = EXTERNAL[case]
    if (reason := missing()) is not None:
        pytest.skip(f"{case}: {reason}")
    _check(name, tiny, tmp_path, server.base_url)
