"""hyssm, llama.cpp's llama-server and transformers ``generate`` on one checkpoint, one table.

One invocation runs the three systems on the same prompts: hyssm and llama-server are both started and
their runs alternate (run 1 of each, then run 2 of each, ...; --sequential: one server at a time, all its
runs), so that the k-th runs of both meet the same minute of a machine whose speed drifts; then
transformers:

    python benchmarks/make_bench_model.py --shape granite-4.0-h-350m /work/bench-models/granite-350m
    python benchmarks/bench_peers.py --model /work/bench-models/granite-350m --runs 3 --output-json peers.json
    python benchmarks/bench_peers.py --model lfm2-1.2b --dtype bfloat16   # a family shape (peers_model.py)

All three run the weights in --dtype (float32, the default, or bfloat16; see peers_commands.py):
- hyssm: ``launch.py --model-path MODEL --dtype DTYPE [--hyssm-args ...]`` on a free loopback port,
  native /generate (its pool sizes are launch.py's defaults unless --hyssm-args sets them);
- llama.cpp: ``llama-server -m MODEL.f32.gguf --parallel 32 --threads $(nproc) -c CTX --metrics``
  (``MODEL.bf16.gguf`` for bfloat16), native /completion with cache_prompt. CTX (--llama-ctx, see
  peers_commands.py): by default hyssm's KV pool as its /metrics reports it (llama-server starts once
  hyssm is ready), so for the peak RSS both hold as many tokens; raised (and said) where a slot could not
  hold the longest prompt. The report states both servers' configurations (flags, pools, per-slot
  context). The GGUF is converted on first use (``llama-server.sh convert ... f32|bf16``) and cached
  beside the model directory, one file per type (redone when older than the weights); a checkpoint
  llama.cpp cannot load as it is (e.g. a BPE tokenizer without merges) is converted from a staged copy,
  see peers_gguf.py. Skipped with a message when the binary (``--llama-server``, default: where
  ``llama-server.sh build`` puts it) does not exist; this tool never builds it;
- transformers: peers_transformers.py in a subprocess, the model loaded in DTYPE (skipped with a message
  when not installed).
Workload per run k (prompts from random.Random(seed + k), the same for every system; ids avoid the
config's bos/eos/pad; see peers_prompts.py), in this order:
- warm-up (run 1 only, not measured): one --input-len prompt made of an id reserved for it, 2 new tokens;
- throughput: --input-len (128) token prompts with --output-len (32) new tokens, greedy, EOS ignored,
  at each concurrency level (one wave of c distinct prompts; transformers: one static batch of c);
  ms per decode token = median inter-token latency at concurrency 1;
- cold prompt: one new --input-len prompt sharing no token with the warm-up prompt and no first id with
  the throughput prompts, 1 new token (its TTFT);
- continuation of a cached prompt: a --prefix-len (512) token prompt P sent alone, then P plus
  --suffix-len (32) new tokens (TTFT of that request; the server can resume from where P ended);
- shared prefix, new suffix (many users sharing a system prompt): a fresh --prefix-len prompt P2 (no
  prefix in common with the prompts above) and three distinct --suffix-len suffixes; P2+sA, then P2+sB,
  one at a time, 1 new token each (not measured: how a server learns the shared prefix), then P2+sC,
  whose TTFT is measured (the server must branch off P2, not continue a previous prompt).
transformers keeps no cache: it gets the measured prompt of each of the last two as a whole prompt.
Settle period: before every measured TTFT request (cold, continuation, shared prefix) the server must be
idle: no request running or queued by its own /metrics for --settle-quiet seconds, its process tree
under --settle-cpu cores meanwhile (peers_settle.py; bounded by --settle-timeout), so no figure holds the
tail of the wave before it (e.g. llama-server still busy with the concurrency-32 wave); transformers
waits likewise until its own process is idle. The seconds waited are in each run's JSON (settle_*_s).
Peak RSS = the process tree's summed VmRSS over the server's whole life.
Figures are medians over --runs; see peers_report.py for the table. Servers are stopped (their
process group only) at the end, on error and on Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import logging
import os
import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a file: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_serving import BenchConfig, run_requests  # noqa: E402
from benchmarks.peers_commands import (  # noqa: E402
    DEFAULT_PEERS_SCRIPT,
    DTYPES,
    PeersConfig,
    default_llama_server,
    hyssm_command,
    hyssm_config_line,
    llama_command,
    llama_config_line,
    llama_context,
    transformers_job,
)
from benchmarks.peers_gguf import gguf_for  # noqa: E402
from benchmarks.peers_model import is_shape, peers_checkpoint  # noqa: E402
from benchmarks.peers_procs import ManagedProcess, PeerError, free_port, stop_on_sigterm  # noqa: E402
from benchmarks.peers_prompts import RunPrompts, make_prompts, model_ids  # noqa: E402
from benchmarks.peers_report import format_table, median_runs, to_json  # noqa: E402
from benchmarks.peers_settle import SettleConfig, read_pools, settle  # noqa: E402
from benchmarks.serving_metrics import RequestSpec, compute_metrics  # noqa: E402

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
Pools = dict[str, dict[str, int]]  # server name -> the pool sizes it reported (peers_settle.read_pools)


def llama_skip_reason(cfg: PeersConfig) -> str | None:
    if cfg.skip_llama:
        return "llama.cpp: skipped (--skip-llama)"
    binary = Path(cfg.llama_server) if cfg.llama_server else default_llama_server(cfg.peers_script)
    if binary is None or not os.access(binary, os.X_OK):
        return (
            f"llama.cpp: skipped: no llama-server binary at {binary} (build it with "
            f"`bash {cfg.peers_script} build`, ~20 min on 2 cores, or pass --llama-server PATH)"
        )
    return None


def transformers_skip_reason(cfg: PeersConfig, find_spec=importlib.util.find_spec) -> str | None:  # noqa: ANN001
    if cfg.skip_transformers:
        return "transformers: skipped (--skip-transformers)"
    if cfg.quantization:
        return f"transformers: skipped (no {cfg.quantization} CPU path to compare)"
    if find_spec("transformers") is None:
        return "transformers: skipped: transformers is not installed (`pip install transformers` adds this column)"
    return None


async def _one_wave(
    client: httpx.AsyncClient, bc: BenchConfig, prompts: list[list[int]], out_len: int, desc: str
) -> dict[str, object]:
    specs = [RequestSpec(p, out_len) for p in prompts]
    cfg = dataclasses.replace(bc, concurrency=len(specs))
    results, duration = await run_requests(client, cfg, specs, [0.0] * len(specs), None, desc)
    m = compute_metrics(results, duration)
    if m["failed"]:
        raise PeerError(f"{desc}: {m['failed']} of {len(specs)} requests failed, first: {m['errors'][0]}")  # type: ignore[index]
    return m


async def _ttft_after_settling(client: httpx.AsyncClient, bc: BenchConfig, prompts: list[list[int]], pid: int | None,
                               cfg: PeersConfig, desc: str) -> tuple[float, float]:  # fmt: skip
    """Wait until the server is idle (peers_settle), then one wave of 1 new token each; (TTFT ms, seconds waited)."""
    sc = SettleConfig(quiet_s=cfg.settle_quiet_s, timeout_s=cfg.settle_timeout_s, max_cpu=cfg.settle_cpu)
    waited = await settle(client, pid, sc, f"{desc}: settle")
    w = await _one_wave(client, bc, prompts, 1, desc)
    return float(w["ttft_ms"]["median"]), waited["settle_s"]  # type: ignore[index]


async def measure_http(
    base_url: str, backend: str, run: RunPrompts, cfg: PeersConfig, warmup: bool, pid: int | None = None
) -> dict[str, float]:
    """One run's figures against a ready server (see the module docstring); `pid`: its process, whose
    tree's CPU use the settle period watches (None: its reported load alone)."""
    bc = BenchConfig(base_url=base_url, backend=backend, disable_tqdm=True, timeout_s=cfg.request_timeout_s)
    # a fresh connection per request: llama-server may close an idle keep-alive connection just as the next
    # request goes out on it ("Server disconnected without sending a response"); loopback setup costs ~0.1 ms
    limits = httpx.Limits(max_connections=max(cfg.levels), max_keepalive_connections=0)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)
    m: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        if warmup:  # first-request costs (allocators, lazy init) stay out of the figures
            await _one_wave(client, bc, run["warmup"], 2, f"{backend} warm-up")  # type: ignore[arg-type]
        for c, prompts in run["throughput"].items():  # type: ignore[attr-defined]
            w = await _one_wave(client, bc, prompts, cfg.output_len, f"{backend} concurrency {c}")
            m[f"tps_c{c}"] = float(w["output_token_throughput"])  # type: ignore[arg-type]
            if c == 1:
                m["decode_ms"] = float(w["itl_ms"]["median"])  # type: ignore[index]
        m["ttft_cold_ms"], m["settle_cold_s"] = await _ttft_after_settling(
            client, bc, run["cold"], pid, cfg, f"{backend} cold prompt")  # type: ignore[arg-type]  # fmt: skip
        await _one_wave(client, bc, run["prefix_only"], 1, f"{backend} prefix")  # type: ignore[arg-type]
        m["ttft_prefix_ms"], m["settle_prefix_s"] = await _ttft_after_settling(
            client, bc, run["prefix"], pid, cfg, f"{backend} prefix hit")  # type: ignore[arg-type]  # fmt: skip
        for i, prompt in enumerate(run["shared_warm"]):  # type: ignore[attr-defined]
            await _one_wave(client, bc, [prompt], 1, f"{backend} shared prefix, request {i + 1}")  # one at a time
        m["ttft_shared_ms"], m["settle_shared_s"] = await _ttft_after_settling(
            client, bc, run["shared"], pid, cfg, f"{backend} shared prefix, measured request")  # type: ignore[arg-type]  # fmt: skip
    return m


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """One server to measure: its name in the table, its command, port and HTTP dialect. The command may
    be a function of the pools the servers started before it reported (built just before it starts)."""

    name: str
    cmd: list[str] | Callable[[Pools], list[str]]
    port: int
    backend: str

    def command(self, pools: Pools) -> list[str]:
        return self.cmd(pools) if callable(self.cmd) else self.cmd


def run_servers(specs: list[ServerSpec], runs: list[RunPrompts], cfg: PeersConfig, log_dir: Path,
                pools: Pools | None = None) -> tuple[dict[str, list[dict[str, float]]], list[str]]:  # fmt: skip
    """Start every server in `specs` in turn, each once the one before is ready (a hyssm server's pool
    sizes are read then, into `pools`, which the later commands may use), then measure run 1 on each in turn, then
    run 2, ...: on a machine whose speed drifts from one minute to the next, the systems' k-th runs meet
    the same minute (a server waits idle while another is measured). Returns each server's per-run
    figures, its process tree's peak RSS added to every run, and a note per server that failed (stopped
    then; the others go on). Every server is stopped at the end, on error and on Ctrl-C."""
    procs: dict[str, ManagedProcess] = {}
    pools = {} if pools is None else pools
    out: dict[str, list[dict[str, float]]] = {s.name: [] for s in specs}
    notes: list[str] = []

    def fail(spec: ServerSpec, e: PeerError) -> None:
        notes.append(f"{spec.name}: failed: {e}\n--- {spec.name} log tail ---\n{procs[spec.name].log_tail()}")
        procs[spec.name].stop()
        del out[spec.name]

    try:
        for spec in specs:
            cmd = spec.command(pools)
            procs[spec.name] = ManagedProcess(spec.name, cmd, log_dir / f"{spec.name}.log", cwd=str(REPO))
            try:
                ready_s = procs[spec.name].wait_ready(f"http://127.0.0.1:{spec.port}/health", cfg.ready_timeout_s)
                logger.info("%s ready in %.1fs", spec.name, ready_s)
                if spec.backend == "hyssm":
                    pools[spec.name] = read_pools(f"http://127.0.0.1:{spec.port}")
            except PeerError as e:
                fail(spec, e)
        for k, run in enumerate(runs):
            for spec in specs:
                if spec.name not in out:
                    continue
                try:
                    m = asyncio.run(measure_http(f"http://127.0.0.1:{spec.port}", spec.backend, run, cfg,
                                                 warmup=k == 0, pid=procs[spec.name].proc.pid))  # fmt: skip
                except PeerError as e:
                    fail(spec, e)
                    continue
                out[spec.name].append(m)
                logger.info("%s run %d: %s", spec.name, k + 1, m)
    finally:
        for proc in procs.values():
            proc.stop()
    for name, measured in out.items():
        for m in measured:
            m["peak_rss_mib"] = procs[name].peak_rss_bytes / 2**20
    return out, notes


def run_transformers(runs: list[RunPrompts], cfg: PeersConfig, log_dir: Path) -> list[dict[str, float]]:
    """peers_transformers.py on the runs' prompts in a subprocess; its per-run figures, peak RSS added.
    Raises PeerError when it fails or ran in another dtype than cfg.dtype."""
    job = transformers_job(runs, cfg)
    job_path, out_path = log_dir / "transformers_job.json", log_dir / "transformers_out.json"
    job_path.write_text(json.dumps(job))
    cmd = [sys.executable, str(REPO / "benchmarks" / "peers_transformers.py"), str(job_path), str(out_path)]
    proc = ManagedProcess("transformers", cmd, log_dir / "transformers.log", cwd=str(REPO))
    try:
        rc = proc.wait(cfg.request_timeout_s)
    finally:
        proc.stop()
    if rc != 0 or not out_path.is_file():
        raise PeerError(f"transformers subprocess exited with {rc}:\n{proc.log_tail()}")
    doc = json.loads(out_path.read_text())
    if doc.get("dtype") != cfg.dtype:
        raise PeerError(f"transformers ran in {doc.get('dtype')}, not {cfg.dtype}:\n{proc.log_tail()}")
    out = doc["runs"]
    for m in out:
        m["peak_rss_mib"] = proc.peak_rss_bytes / 2**20
    return out


def _llama_spec(cfg: PeersConfig, binary: str, gguf: Path, port: int, configs: dict[str, str]) -> ServerSpec:
    """llama-server's spec, its -c taken from hyssm's reported pools when it starts (and its config line
    written into `configs` then)."""

    def command(pools: Pools) -> list[str]:
        ctx, how = llama_context(cfg, pools.get("hyssm", {}).get("kv_tokens"))
        configs["llama.cpp"] = llama_config_line(cfg, ctx, how)
        return llama_command(cfg, binary, gguf, port, ctx)

    return ServerSpec("llama.cpp", command, port, "llama-server")


Medians = dict[str, dict[str, float | None]]


def benchmark(cfg: PeersConfig, log_dir: Path,
              configs: dict[str, str] | None = None) -> tuple[Medians, dict[str, list], list[str]]:  # fmt: skip
    """Run every system not skipped; returns medians, per-run figures and notes (skips, failures). Each
    server's configuration line (flags, pools) goes into `configs`."""
    vocab, banned = model_ids(cfg.model)
    runs = make_prompts(cfg, vocab, banned)
    per_run: dict[str, list] = {}
    notes: list[str] = []
    configs = {} if configs is None else configs
    pools: Pools = {}
    port = free_port()
    specs = [ServerSpec("hyssm", hyssm_command(cfg, port), port, "hyssm")]
    llama_skip = llama_skip_reason(cfg)
    if llama_skip:
        notes.append(llama_skip)
    else:
        try:
            gguf, llama_port = gguf_for(cfg.model, cfg.peers_script, log_dir, cfg.gguf_type), free_port()
            binary = cfg.llama_server or str(default_llama_server(cfg.peers_script))
            specs.append(_llama_spec(cfg, binary, gguf, llama_port, configs))
        except PeerError as e:
            notes.append(f"llama.cpp: failed: {e}")
    for group in [[spec] for spec in specs] if cfg.sequential else [specs]:
        measured, failed = run_servers(group, runs, cfg, log_dir, pools)
        per_run.update(measured)
        notes.extend(failed)
    configs["hyssm"] = hyssm_config_line(cfg, pools.get("hyssm"))
    skip = transformers_skip_reason(cfg)
    if skip:
        notes.append(skip)
    else:
        try:
            per_run["transformers"] = run_transformers(runs, cfg, log_dir)
        except PeerError as e:
            notes.append(f"transformers: failed: {e}")
    medians = {name: median_runs(r) for name, r in per_run.items()}
    notes.insert(
        0,
        f"workload: {cfg.input_len}-token prompts, {cfg.output_len} new tokens, greedy, EOS ignored; "
        f"continuation: a {cfg.prefix_len}-token prompt, then it + {cfg.suffix_len} new prompt tokens; "
        f"shared prefix: a new {cfg.prefix_len}-token prefix with 3 distinct {cfg.suffix_len}-token suffixes "
        f"sent in turn, the third measured; "
        f"medians of {cfg.runs} run(s); threads {cfg.threads}; before each measured TTFT the server idle (no "
        f"request running or queued) for {cfg.settle_quiet_s:g}s with its processes under {cfg.settle_cpu:g} cores",
    )
    return medians, per_run, notes


def parse_args(argv: Sequence[str] | None = None) -> PeersConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model", required=True, help="checkpoint directory (e.g. from make_bench_model.py), or a make_family_model "
      "shape (e.g. lfm2-1.2b), written once in transformers' layout (peers_model.py)")
    a("--runs", type=int, default=3, help="measured runs per system; the table shows medians")
    a("--dtype", choices=DTYPES, default="float32", help="weights of every system (llama.cpp: an f32 or bf16 GGUF)")
    a("--quantization", choices=("int8", "int4"), default="",
      help="hyssm --quantization against llama.cpp's Q8_0 (int8) or Q4_K_M (int4) file; transformers is skipped")
    a("--skip-llama", action="store_true")
    a("--skip-transformers", action="store_true")
    a("--sequential", action="store_true",
      help="start one server at a time and measure all its runs (less memory); by default both servers are up and "
           "their runs alternate")
    a("--llama-server", default=None, metavar="PATH", help="llama-server binary (default: llama-server.sh's)")
    a("--hyssm-args", default="", help="extra launch.py flags, one string (e.g. '--max-mamba-cache-size 64')")
    a("--llama-ctx", default="hyssm", metavar="hyssm|workload|N",
      help="llama-server -c: hyssm = hyssm's KV pool as its server reports it (default; the same tokens in memory), "
           "workload = what the prompts need, N = N tokens; raised where a slot could not hold the longest prompt")
    a("--settle-quiet", dest="settle_quiet_s", type=float, default=0.5,
      help="before each measured TTFT: seconds the server must report no request running or queued")
    a("--settle-cpu", type=float, default=0.25, help="cores the server's processes may use in that quiet window")
    a("--settle-timeout", dest="settle_timeout_s", type=float, default=120.0,
      help="seconds to wait for a server to settle before the run fails")
    a("--peers-script", default=str(DEFAULT_PEERS_SCRIPT), help="llama-server.sh (build / convert)")
    a("--threads", type=int, default=os.cpu_count() or 1, help="llama-server --threads and transformers threads")
    a("--levels", default="1,8,32", help="concurrency levels, comma-separated")
    a("--input-len", type=int, default=128)
    a("--output-len", type=int, default=32)
    a("--prefix-len", type=int, default=512)
    a("--suffix-len", type=int, default=32)
    a("--seed", type=int, default=0)
    a("--ready-timeout", dest="ready_timeout_s", type=float, default=900.0, help="seconds for a server to be ready")
    a("--request-timeout", dest="request_timeout_s", type=float, default=3600.0)
    a("--output-json", default=None, metavar="PATH")
    a("--plot", default=None, metavar="PNG", help="figure of the table (needs matplotlib: pip install 'hyssm[bench]')")
    a("--log-dir", default=None, help="server logs (default: a temporary directory, kept)")
    a("--log-level", default="INFO")
    ns = p.parse_args(argv)
    try:
        ns.levels = tuple(int(x) for x in ns.levels.split(","))
    except ValueError:
        p.error(f"--levels must be comma-separated integers, got {ns.levels!r}")
    if any(c < 1 for c in ns.levels) or 1 not in ns.levels:
        p.error("--levels must be positive and include 1 (ms per decode token is read at concurrency 1)")
    for name in ("runs", "input_len", "output_len", "prefix_len", "suffix_len", "threads"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not is_shape(ns.model) and not os.path.isfile(os.path.join(ns.model, "config.json")):
        p.error(f"--model {ns.model!r} has no config.json (and is no make_family_model shape)")
    ns.model = ns.model if is_shape(ns.model) else os.path.abspath(ns.model)
    ns.hyssm_args = tuple(shlex.split(ns.hyssm_args))
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    del ns.log_level
    try:
        return PeersConfig(**vars(ns))
    except ValueError as e:  # --llama-ctx, --settle-*
        p.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table (and write JSON with --output-json); exit 1 when hyssm could not be measured."""
    cfg = parse_args(argv)
    with stop_on_sigterm():
        log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="bench_peers_"))
        log_dir.mkdir(parents=True, exist_ok=True)
        logger.info("logs in %s", log_dir)
        cfg = dataclasses.replace(cfg, model=peers_checkpoint(cfg.model, cfg.dtype))  # a shape: its checkpoint
        configs: dict[str, str] = {}
        medians, per_run, notes = benchmark(cfg, log_dir, configs)
    print(format_table(medians, notes, dtype=cfg.weights, configs=configs))
    if cfg.output_json:
        Path(cfg.output_json).write_text(to_json(medians, per_run, notes, dataclasses.asdict(cfg), dtype=cfg.weights,
                                                 configs=configs))  # fmt: skip
    if cfg.plot and medians:
        from benchmarks.bench_plots import plot_peers, save_figure

        save_figure(plot_peers(medians, title=f"bench_peers: {Path(cfg.model).name} ({cfg.weights})"), cfg.plot)
    return 0 if "hyssm" in medians else 1

if __name__ == "__main__":
    sys.exit(main())
