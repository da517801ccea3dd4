"""hyssm with and without `--speculative-algorithm NGRAM`, and llama.cpp, on the same requests: one table.

    python benchmarks/bench_speculative.py --model /work/bench-models/granite-350m-tf --dtype bfloat16 --runs 3

Two workloads per run k (seeds from random.Random(seed + k)), each at every --levels concurrency (one
wave of c requests, --output-len new tokens, greedy, EOS ignored):
- repeat: the model's own text. A --seed-len token seed s and its greedy continuation G of
  --input-len - seed-len tokens (asked of the plain hyssm server first) make the prompt s + G, whose
  greedy continuation is G's own: where the model repeats itself (lists, code, a degenerate random
  model's loops), what follows is in the prompt already (what prompt lookup drafts);
- random: --input-len random token ids (little for a draft to match).
Before each measured wave one untimed 1-token request waits out what the server still does after the
previous wave (llama-server answers the next request seconds late after a 32-wide wave). The systems:
hyssm as launched (plain), hyssm with --speculative-args (default: NGRAM, 4 draft tokens),
llama.cpp's llama-server on the same GGUF as bench_peers (skipped without the binary). Per cell: output
tok/s, the speculative server's tokens per verify step (1 + accepted drafts / verify steps, from its
/metrics) and the ratios spec / plain and spec / llama.cpp. Medians over --runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import shlex
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a file: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_peers import _one_wave, llama_skip_reason  # noqa: E402
from benchmarks.bench_serving import BenchConfig  # noqa: E402
from benchmarks.peers_commands import DTYPES, PeersConfig, default_llama_server, hyssm_command, llama_command  # noqa: E402
from benchmarks.peers_gguf import gguf_for  # noqa: E402
from benchmarks.peers_procs import ManagedProcess, PeerError, free_port  # noqa: E402
from benchmarks.peers_prompts import model_ids  # noqa: E402
from benchmarks.server_stats import prometheus_sum  # noqa: E402

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = ("repeat", "random")
Prompts = dict[str, dict[int, list[list[int]]]]  # workload -> level -> prompts


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    peers: PeersConfig
    seed_len: int = 16
    speculative_args: tuple[str, ...] = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4")


def _draw(rng: random.Random, n: int, vocab: int, banned: set[int]) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(vocab)
        if t not in banned:
            out.append(t)
    return out


async def _greedy(client: httpx.AsyncClient, ids: list[int], n: int) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = await client.post("/generate", json=body)
    r.raise_for_status()
    return r.json()["output_ids"]


async def make_prompts(base_url: str, cfg: SpecConfig, vocab: int, banned: set[int]) -> list[Prompts]:
    """Per run, both workloads' prompts; the repeat seeds' continuations come from the server at `base_url`."""
    p = cfg.peers
    runs = []
    async with httpx.AsyncClient(base_url=base_url, timeout=p.request_timeout_s) as client:
        for k in range(p.runs):
            rng = random.Random(p.seed + k)
            run: Prompts = {"random": {}, "repeat": {}}
            for c in p.levels:
                run["random"][c] = [_draw(rng, p.input_len, vocab, banned) for _ in range(c)]
                seeds = [_draw(rng, cfg.seed_len, vocab, banned) for _ in range(c)]
                conts = await asyncio.gather(*(_greedy(client, s, p.input_len - cfg.seed_len) for s in seeds))
                run["repeat"][c] = [s + g for s, g in zip(seeds, conts, strict=True)]
            runs.append(run)
    return runs


async def _spec_counts(client: httpx.AsyncClient) -> tuple[float, float]:
    text = (await client.get("/metrics")).text
    return (prometheus_sum(text, "hyssm_spec_verify_steps_total") or 0.0,
            prometheus_sum(text, "hyssm_spec_accepted_tokens_total") or 0.0)


async def measure(base_url: str, backend: str, prompts: list[Prompts], cfg: SpecConfig) -> list[dict[str, float]]:
    """Per run: `{workload}_c{c}` output tok/s and, for a hyssm server, `{workload}_c{c}_accept` tokens
    per verify step (NaN when nothing was verified)."""
    p = cfg.peers
    bc = BenchConfig(base_url=base_url, backend=backend, disable_tqdm=True, timeout_s=p.request_timeout_s)
    limits = httpx.Limits(max_connections=max(p.levels), max_keepalive_connections=0)
    out = []
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=p.request_timeout_s) as client:
        probe = [prompts[0]["random"][min(p.levels)][0][:16]]
        await _one_wave(client, bc, probe, 2, f"{backend} warm-up")
        for run in prompts:
            m: dict[str, float] = {}
            for workload in WORKLOADS:
                for c, wave in run[workload].items():
                    # untimed: whatever a server does after a wave (llama-server: seconds after a
                    # wide one) is not charged to the next
                    await _one_wave(client, bc, probe, 1, f"{backend} settle")
                    before = await _spec_counts(client) if backend == "hyssm" else (0.0, 0.0)
                    w = await _one_wave(client, bc, wave, p.output_len, f"{backend} {workload} c{c}")
                    m[f"{workload}_c{c}"] = float(w["output_token_throughput"])  # type: ignore[arg-type]
                    if backend == "hyssm":
                        after = await _spec_counts(client)
                        steps = after[0] - before[0]
                        m[f"{workload}_c{c}_accept"] = 1 + (after[1] - before[1]) / steps if steps else float("nan")
            out.append(m)
    return out


def run_system(name: str, cmd: list[str], port: int, backend: str, cfg: SpecConfig, log_dir: Path,
               work) -> object:  # noqa: ANN001  (work: base_url -> coroutine)
    proc = ManagedProcess(name, cmd, log_dir / f"{name}.log", cwd=str(REPO))
    try:
        proc.wait_ready(f"http://127.0.0.1:{port}/health", cfg.peers.ready_timeout_s)
        return asyncio.run(work(f"http://127.0.0.1:{port}"))
    except PeerError as e:
        raise PeerError(f"{e}\n--- {name} log tail ---\n{proc.log_tail()}") from None
    finally:
        proc.stop()


def benchmark(cfg: SpecConfig, log_dir: Path) -> tuple[dict[str, dict[str, float]], list[str]]:
    p = cfg.peers
    vocab, banned = model_ids(p.model)
    results: dict[str, list[dict[str, float]]] = {}
    notes: list[str] = []
    port = free_port()

    async def plain(url: str) -> tuple[list[Prompts], list[dict[str, float]]]:
        prompts = await make_prompts(url, cfg, vocab, banned)
        return prompts, await measure(url, "hyssm", prompts, cfg)

    prompts, results["hyssm"] = run_system("hyssm", hyssm_command(p, port), port, "hyssm", cfg, log_dir, plain)  # type: ignore[misc]
    port = free_port()
    spec_cmd = hyssm_command(dataclasses.replace(p, hyssm_args=p.hyssm_args + cfg.speculative_args), port)
    results["hyssm+spec"] = run_system("hyssm-spec", spec_cmd, port, "hyssm", cfg, log_dir,
                                       lambda url: measure(url, "hyssm", prompts, cfg))  # type: ignore[assignment]
    skip = llama_skip_reason(p)
    if skip:
        notes.append(skip)
    else:
        gguf, port = gguf_for(p.model, p.peers_script, log_dir, p.gguf_type), free_port()
        binary = p.llama_server or str(default_llama_server(p.peers_script))
        results["llama.cpp"] = run_system("llama.cpp", llama_command(p, binary, gguf, port), port, "llama-server",
                                          cfg, log_dir, lambda url: measure(url, "llama-server", prompts, cfg))  # type: ignore[assignment]
    medians = {name: {k: _median([r[k] for r in runs]) for k in runs[0]} for name, runs in results.items()}
    return medians, notes


def _median(values: list[float]) -> float:
    """The median of the values that are numbers (NaN: none is)."""
    real = [v for v in values if v == v]
    return statistics.median(real) if real else float("nan")


def format_table(medians: dict[str, dict[str, float]], cfg: SpecConfig) -> str:
    p = cfg.peers
    plain, spec, llama = medians["hyssm"], medians["hyssm+spec"], medians.get("llama.cpp")
    head = "| workload | c | hyssm tok/s | hyssm+spec tok/s | tokens / verify step | spec / plain |"
    head += " llama.cpp tok/s | spec / llama.cpp |" if llama else ""
    lines = [f"{p.dtype}, {p.input_len}-token prompts, {p.output_len} new tokens, medians of {p.runs} runs; "
             f"spec: {' '.join(cfg.speculative_args)}", "", head, "|" + "---|" * (head.count("|") - 1)]
    for workload in WORKLOADS:
        for c in p.levels:
            key = f"{workload}_c{c}"
            row = (f"| {workload} | {c} | {plain[key]:.2f} | {spec[key]:.2f} | {spec[key + '_accept']:.2f} | "
                   f"{spec[key] / plain[key]:.2f}x |")
            if llama:
                row += f" {llama[key]:.2f} | {spec[key] / llama[key]:.2f}x |"
            lines.append(row)
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> SpecConfig:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = ap.add_argument
    a("--model", required=True)
    a("--runs", type=int, default=3)
    a("--dtype", choices=DTYPES, default="float32")
    a("--levels", default="1,8,32")
    a("--input-len", type=int, default=128)
    a("--output-len", type=int, default=32)
    a("--seed-len", type=int, default=16)
    a("--seed", type=int, default=0)
    a("--hyssm-args", default="", help="extra launch.py flags of both hyssm servers")
    a("--speculative-args", default="--speculative-algorithm NGRAM --speculative-num-draft-tokens 4")
    a("--skip-llama", action="store_true")
    a("--llama-server", default=None)
    a("--peers-script", default=str(PeersConfig.__dataclass_fields__["peers_script"].default))
    a("--output-json", default=None)
    a("--log-dir", default=None)
    ns = ap.parse_args(argv)
    levels = tuple(int(x) for x in ns.levels.split(","))
    if ns.input_len <= ns.seed_len or ns.runs < 1 or any(c < 1 for c in levels):
        ap.error("--input-len must exceed --seed-len; --runs and --levels must be positive")
    peers = PeersConfig(model=str(Path(ns.model).resolve()), runs=ns.runs, dtype=ns.dtype, levels=levels,
                        input_len=ns.input_len, output_len=ns.output_len, seed=ns.seed,
                        hyssm_args=tuple(shlex.split(ns.hyssm_args)), skip_llama=ns.skip_llama,
                        llama_server=ns.llama_server, peers_script=ns.peers_script, output_json=ns.output_json,
                        log_dir=ns.log_dir, prefix_len=ns.input_len, suffix_len=1)  # fmt: skip
    return SpecConfig(peers, ns.seed_len, tuple(shlex.split(ns.speculative_args)))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    log_dir = Path(cfg.peers.log_dir or tempfile.mkdtemp(prefix="bench_spec_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    medians, notes = benchmark(cfg, log_dir)
    print(format_table(medians, cfg))
    for note in notes:
        print(note)
    if cfg.peers.output_json:
        Path(cfg.peers.output_json).write_text(json.dumps({"medians": medians, "notes": notes}, indent=1,
                                                          default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
