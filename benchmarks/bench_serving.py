"""Load generator for a running server: hyssm ``/generate``, any OpenAI ``/v1/completions``, llama-server.

Talks to the server only over HTTP; imports nothing from the engine.

    python benchmarks/bench_serving.py --num-prompts 64 --concurrency 8 --input-len 256 --output-len 64
    python benchmarks/bench_serving.py --backend openai --base-url http://127.0.0.1:8000 --vocab-size 100352
    python benchmarks/bench_serving.py --backend llama-server --port 8080 --concurrency 8
    python benchmarks/bench_serving.py --shared-prefix-len 300 --num-prefix-groups 1 --input-len 40 \
        --concurrency 1 --output-json out.json

Workload: prompts are random token ids from ``random.Random(seed)`` in ``[0, vocab_size)``; lengths are
uniform in ``[L*(1-r), L*(1+r)]`` (``r = --range-ratio``). With ``--shared-prefix-len P`` every prompt is
a group prefix of P ids (``--num-prefix-groups`` distinct prefixes, assigned round-robin) followed by a
distinct suffix whose length follows ``--input-len``. Arrivals are Poisson at ``--request-rate`` (inf:
all at once), at most ``--concurrency`` in flight. ``--warmup`` requests use their own random prompts.

Metric definitions live in serving_metrics.py; the server's own prefix hit rate and the requests
each ``--dp-size`` replica took (read from /metrics and /get_server_info around each run, when the
server has them) in server_stats.py. Report: a table on stdout and, with ``--output-json``,
the same numbers as strict JSON (NaN -> null). Diagnostics go to logging. Request bodies per backend
(``--backend hyssm|openai|llama-server``; ``generate`` is an alias of hyssm; ``--prompt-format text`` for
servers or routers that take only text prompts, e.g. sglang-router's /v1/completions) are in serving_backends.py;
the vocabulary size comes from ``--vocab-size``, else /get_server_info (hyssm, SGLang), else
/v1/models (llama-server's ``meta.n_vocab``), else 256.

Load sweeps (``--sweep-concurrency 1,2,4,8`` or ``--sweep-rate 1,2,4``, one run per level, several
servers with ``--target LABEL=BACKEND@URL``, a figure with ``--plot out.png`` and its data with
``--out-json``) are bench_sweep.py's; the figure is bench_plots.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

if __package__ in (None, ""):  # run as a file (python benchmarks/bench_serving.py): make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_sweep import (  # noqa: E402
    SWEEP_DESTS,
    SweepOptions,
    add_sweep_flags,
    check_plotting,
    run_sweep,
    some_level_failed,
    summary_lines,
    sweep_options,
    write_outputs,
)
from benchmarks.server_stats import counters_delta, read_counters  # noqa: E402
from benchmarks.serving_backends import ALIASES, BACKENDS, canonical_backend, request_for  # noqa: E402
from benchmarks.serving_metrics import (  # noqa: E402
    RequestResult,
    RequestSpec,
    apply_chunk,
    build_requests,
    compute_metrics,
    find_vocab_size,
    format_report,
    json_safe,
    median_metrics,
    poisson_gaps,
)

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 256
# --shared-prefix: issue 5's workload (300-token system prompt, distinct 40-token suffixes, one at a time).
SHARED_PREFIX_PRESET: dict[str, object] = {
    "shared_prefix_len": 300,
    "num_prefix_groups": 1,
    "input_len": 40,
    "output_len": 16,
    "num_prompts": 16,
    "concurrency": 1,
}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark invocation; the defaults are the CLI's (bench_peers builds these directly)."""

    base_url: str
    backend: str = "hyssm"
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 100
    concurrency: int | None = None
    request_rate: float = math.inf
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    shared_prefix_len: int = 0
    num_prefix_groups: int = 1
    vocab_size: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, object] = field(default_factory=dict)
    prompt_format: str = "ids"
    warmup: int = 0
    flush_cache: bool = False
    runs: int = 1
    timeout_s: float = 3600.0
    disable_tqdm: bool = False
    output_json: str | None = None
    log_level: str = "WARNING"
    sweep: SweepOptions | None = None  # --sweep-concurrency / --sweep-rate (bench_sweep.py); None: one run


# ---------------------------------------------------------------- HTTP client


def _payload(cfg: BenchConfig, spec: RequestSpec, model: str | None) -> tuple[str, dict[str, object]]:
    return request_for(cfg.backend, spec.prompt_ids, spec.output_len, model=model, temperature=cfg.temperature,
                       ignore_eos=cfg.ignore_eos, extra=cfg.extra_body,
                       as_text=cfg.prompt_format == "text")  # fmt: skip


async def send_request(
    client: httpx.AsyncClient, cfg: BenchConfig, spec: RequestSpec, model: str | None
) -> RequestResult:
    """Send one streaming request; never raises (failures are recorded in the result)."""
    path, body = _payload(cfg, spec, model)
    res = RequestResult(prompt_tokens=len(spec.prompt_ids))
    res.start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                raise RuntimeError(f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                apply_chunk(cfg.backend, json.loads(data), res, time.perf_counter())
        res.end = time.perf_counter()
        if not any(n > 0 for _, n in res.chunks):
            raise RuntimeError("the stream carried no tokens (is the server streaming SSE?)")
        res.success = True
    except Exception as exc:  # one failed request must not stop the benchmark
        res.end = time.perf_counter()
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        logger.debug("request failed: %s", res.error)
    return res


async def run_requests(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    specs: Sequence[RequestSpec],
    gaps: Sequence[float],
    model: str | None,
    desc: str,
) -> tuple[list[RequestResult], float]:
    """Send specs with the given arrival gaps under the concurrency limit; returns results in spec order
    and the wall time from the first send to the last completion."""
    sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    bar = tqdm(total=len(specs), desc=desc, disable=cfg.disable_tqdm)

    async def one(spec: RequestSpec) -> RequestResult:
        if sem is None:
            res = await send_request(client, cfg, spec, model)
        else:
            async with sem:
                res = await send_request(client, cfg, spec, model)
        bar.update(1)
        return res

    t0 = time.perf_counter()
    tasks: list[asyncio.Task[RequestResult]] = []
    for spec, gap in zip(specs, gaps, strict=True):
        if gap > 0:
            await asyncio.sleep(gap)  # load pacing (Poisson arrivals), not synchronisation
        tasks.append(asyncio.create_task(one(spec)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    bar.close()
    return results, duration


async def _discover(client: httpx.AsyncClient, cfg: BenchConfig) -> tuple[int, str | None]:
    """vocab size (flag, else /get_server_info, else /v1/models, else 256) and model name (flag, else
    the first of /v1/models for the openai backend)."""
    vocab = cfg.vocab_size
    listed: object = None
    for path in ("/get_server_info", "/v1/models"):
        if vocab is not None:
            break
        try:
            resp = await client.get(path)
            resp.raise_for_status()
            doc = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            logger.info("could not read %s: %s", path, exc)
            continue
        listed = doc if path == "/v1/models" else listed
        vocab = find_vocab_size(doc)
    if vocab is None:
        logger.warning("vocab size unknown; using %d", DEFAULT_VOCAB_SIZE)
        vocab = DEFAULT_VOCAB_SIZE
    model = cfg.model
    if model is None and cfg.backend == "openai":
        if listed is None:
            resp = await client.get("/v1/models")
            resp.raise_for_status()
            listed = resp.json()
        model = listed["data"][0]["id"]  # type: ignore[index]
    return vocab, model


async def benchmark(cfg: BenchConfig) -> dict[str, object]:
    """Discover, warm up, then cfg.runs measured runs (run k uses seed + k, so runs share no prompts);
    returns the metrics (per-key median over runs, each run under "runs", when runs > 1)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency or max(cfg.num_prompts, cfg.warmup, 1))
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0))
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, limits=limits, timeout=timeout) as client:
        vocab, model = await _discover(client, cfg)
        logger.info("base_url=%s backend=%s vocab_size=%d model=%s", cfg.base_url, cfg.backend, vocab, model)
        if cfg.warmup > 0:
            # Distinct rng stream: warm-up prompts never share a prefix with the measured ones.
            wrng = random.Random(cfg.seed + 1_000_003)
            warm = [
                RequestSpec([wrng.randrange(vocab) for _ in range(cfg.input_len)], min(cfg.output_len, 16))
                for _ in range(cfg.warmup)
            ]
            warm_res, _ = await run_requests(client, cfg, warm, [0.0] * len(warm), model, "warmup")
            failed = [r.error for r in warm_res if not r.success]
            if failed:
                logger.warning("%d/%d warm-up requests failed, first: %s", len(failed), len(warm), failed[0])
        runs = []
        for k in range(cfg.runs):
            runs.append(await _measured_run(client, cfg, vocab, model, cfg.seed + k, f"run {k + 1}/{cfg.runs}"))
    metrics = median_metrics(runs) if len(runs) > 1 else runs[0]
    redacted = "<redacted>" if cfg.api_key else None  # the key never goes into a results file
    metrics["config"] = {**asdict(cfg), "api_key": redacted, "vocab_size": vocab, "model": model}
    if len(runs) > 1:
        metrics["runs"] = runs
    return metrics


async def _measured_run(
    client: httpx.AsyncClient, cfg: BenchConfig, vocab: int, model: str | None, seed: int, desc: str
) -> dict[str, object]:
    """One measured run with prompts drawn from random.Random(seed)."""
    if cfg.flush_cache:
        (await client.post("/flush_cache")).raise_for_status()
    rng = random.Random(seed)
    specs = build_requests(
        rng,
        num_prompts=cfg.num_prompts,
        input_len=cfg.input_len,
        output_len=cfg.output_len,
        range_ratio=cfg.range_ratio,
        shared_prefix_len=cfg.shared_prefix_len,
        num_prefix_groups=cfg.num_prefix_groups,
        vocab_size=vocab,
    )
    gaps = poisson_gaps(rng, cfg.request_rate, len(specs))
    before = await read_counters(client)
    results, duration = await run_requests(client, cfg, specs, gaps, model, desc)
    return {**compute_metrics(results, duration), **counters_delta(before, await read_counters(client))}


# ---------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    """Parse and validate the CLI flags (argparse exits with status 2 on a bad value)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--base-url", default=None, help="overrides --host/--port, e.g. http://10.0.0.2:30000")
    a("--backend", choices=(*BACKENDS, *ALIASES), default="hyssm", help="hyssm /generate, OpenAI /v1/completions, "
      "llama-server /completion (see serving_backends.py)")
    a("--model", default=None, help="OpenAI model name (default: first of /v1/models)")
    a("--api-key", default=None)
    a("--num-prompts", type=int, default=100)
    a("--concurrency", type=int, default=None, help="max requests in flight (default: unbounded)")
    a("--request-rate", type=float, default=math.inf, help="Poisson arrival rate in req/s (default: inf)")
    a("--input-len", type=int, default=256, help="prompt length (the distinct suffix with a shared prefix)")
    a("--output-len", type=int, default=64)
    a("--range-ratio", type=float, default=0.0, help="lengths uniform in [L*(1-r), L*(1+r)]")
    a("--shared-prefix-len", type=int, default=0, help="length of the prefix shared within a group")
    a("--num-prefix-groups", type=int, default=1)
    a("--vocab-size", type=int, default=None, help="default: from /get_server_info, else 256")
    a("--seed", type=int, default=0)
    a("--temperature", type=float, default=0.0)
    a("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let EOS end requests early")
    a("--extra-body", default=None, metavar="JSON", help="JSON object merged into every request body")
    a("--prompt-format", choices=("ids", "text"), default="ids", help="send prompts as token ids, or as text "
      "(one letter per id; the server counts the tokens): sglang-router's /v1/completions takes only text")
    a("--warmup", type=int, default=0, help="unmeasured requests (own random prompts) sent first")
    a("--flush-cache", action="store_true", help="POST /flush_cache before each measured run")
    a("--runs", type=int, default=1, help="measured runs (run k uses seed+k); report the median")
    a("--shared-prefix", action="store_true", help=f"preset (explicit flags win): {SHARED_PREFIX_PRESET}")
    a("--timeout", dest="timeout_s", type=float, default=3600.0, help="per-request timeout in seconds")
    a("--disable-tqdm", action="store_true")
    a("--output-json", default=None, metavar="PATH")
    a("--log-level", default="WARNING")
    add_sweep_flags(p)
    if p.parse_known_args(argv)[0].shared_prefix:
        p.set_defaults(**SHARED_PREFIX_PRESET)
    ns = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "num_prefix_groups", "runs"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if ns.concurrency is not None and ns.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if ns.request_rate <= 0 or not 0.0 <= ns.range_ratio < 1.0 or ns.shared_prefix_len < 0 or ns.warmup < 0:
        p.error("need --request-rate > 0, 0 <= --range-ratio < 1, --shared-prefix-len >= 0, --warmup >= 0")
    try:
        extra = json.loads(ns.extra_body) if ns.extra_body else {}
    except ValueError as exc:
        p.error(f"--extra-body is not valid JSON: {exc}")
    if not isinstance(extra, dict):
        p.error("--extra-body must be a JSON object")
    ns.extra_body = extra
    ns.backend = canonical_backend(ns.backend)
    if ns.flush_cache and ns.backend == "llama-server":
        p.error("--flush-cache needs a /flush_cache endpoint, which llama-server does not have")
    try:
        sweep = sweep_options(ns)
    except ValueError as exc:
        p.error(str(exc))
    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    skip = ("host", "port", "base_url", "shared_prefix", *SWEEP_DESTS)
    return BenchConfig(base_url=base_url, sweep=sweep, **{k: v for k, v in vars(ns).items() if k not in skip})


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: prints the report table; writes JSON with --output-json. Exit 1 if every request failed
    (a sweep: a summary line per level, its JSON and figure; exit 1 if some level completed nothing)."""
    cfg = parse_args(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.sweep is not None:
        check_plotting(cfg.sweep)
        doc = asyncio.run(run_sweep(cfg, cfg.sweep, benchmark))
        print("\n".join(summary_lines(doc)))
        write_outputs(doc, cfg.sweep)
        return 1 if some_level_failed(doc) else 0
    metrics = asyncio.run(benchmark(cfg))
    print(format_report(metrics))
    for err in metrics["errors"]:  # type: ignore[union-attr]
        logger.warning("error seen: %s", err)
    if cfg.output_json:
        with open(cfg.output_json, "w", encoding="utf-8") as f:
            json.dump(json_safe(metrics), f, indent=2, allow_nan=False)
    return 0 if metrics["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
