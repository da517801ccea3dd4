"""LoRA serving throughput: one server, waves of greedy requests at concurrency 8 and 32 under 0 (the base
model), 1, 4 and 8 distinct adapters, and the time an adapter takes to load.

    python -m benchmarks.bench_lora --out lora.json                    # the 350M shape, rank 16, all targets
    python -m benchmarks.bench_lora --shape builtin --concurrency 2 --adapters 0,1 --runs 1   # smoke test

The checkpoint: ``--shape builtin`` is the shipped tiny model; a Granite-4.0-H shape is written once by
make_bench_model.py (``--dtype bfloat16 --init transformers``) to ``--model-dir`` (default
``$XDG_CACHE_HOME/hyssm/bench-models/SHAPE-DTYPE-INIT``) and reused. Adapters are made and saved by peft
(``--rank``, every linear kind of the model: attention q/k/v/o, Mamba in/out_proj, the shared MLP's
input_linear/output_linear; lora_B random), written once under
``$XDG_CACHE_HOME/hyssm/bench-adapters/MODEL-rRANK``.

The server: ``launch.py --lora-paths a1=... a8=... --max-loras-per-batch 8 --max-running-requests C``
(C = the largest concurrency) on a free loopback port in its own process group (stopped, that group only,
at the end and on error), warmed up with one request under the base and under each adapter, then one
unmeasured wave of each adapter count at the largest concurrency. A wave is
``--requests-per-wave`` x concurrency requests of ``--input-len`` random prompt tokens (a fresh prefix each: no
cache hits) and ``--output-len`` greedy tokens (EOS ignored), ``--concurrency`` of them in flight at a time,
the k-th under adapter a(k mod N) (N = 0: all under the base); throughput = output tokens / wave seconds.
Each cell is the median of ``--runs`` waves (base and adapter waves alternate, so drift meets them alike); the
table gives each against the base at the same concurrency. Load time = seconds of POST /load_lora_adapter of
an adapter not loaded before (the tokenizer reads and checks it, every scheduler registers it) plus the first
request under it (the worker reads it into its slot), medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.peers_procs import ManagedProcess, free_port
from benchmarks.state_cache_servers import prepare_model
from shared.config import BUILTIN_MODEL, builtin_model_dir

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "input_linear", "output_linear")


@dataclass(frozen=True)
class Config:
    shape: str
    model_dir: str | None
    rank: int
    runs: int
    concurrency: tuple[int, ...]
    adapters: tuple[int, ...]
    input_len: int
    output_len: int
    requests_per_wave: int
    out: str | None
    log_dir: str


def ensure_adapters(model: str, rank: int, n: int) -> dict[str, str]:
    """n + 1 peft adapters of `model` (the last one is only loaded at run time), made once."""
    from tests.fixtures.lora_adapter import write_peft_adapter

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hyssm" / "bench-adapters"
    folder = cache / f"{Path(model).name}-r{rank}"
    out = {}
    for i in range(1, n + 2):
        path = folder / f"a{i}"
        if not (path / "adapter_model.safetensors").is_file():
            logger.info("writing adapter a%d (rank %d) to %s", i, rank, path)
            base = builtin_model_dir() if model == BUILTIN_MODEL else model
            write_peft_adapter(base, str(path), TARGETS, rank=rank, seed=i, scale=0.02)
        out[f"a{i}"] = str(path)
    return out


async def _one(client: httpx.AsyncClient, ids: list[int], lora: str | None, n: int) -> int:
    body: dict = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    if lora:
        body["lora_path"] = lora
    resp = await client.post("/generate", json=body)
    if resp.status_code != 200:
        raise RuntimeError(f"/generate answered {resp.status_code}: {resp.text[:300]}")
    return int(resp.json()["meta_info"]["completion_tokens"])


async def wave(client: httpx.AsyncClient, cfg: Config, conc: int, n_adapters: int, rng: random.Random,
               vocab: int) -> float:  # fmt: skip
    """Output tokens per second of one wave."""
    total = cfg.requests_per_wave * conc
    loras = [f"a{k % n_adapters + 1}" if n_adapters else None for k in range(total)]
    prompts = [[rng.randrange(3, vocab) for _ in range(cfg.input_len)] for _ in range(total)]
    gate = asyncio.Semaphore(conc)

    async def run(i: int) -> int:
        async with gate:
            return await _one(client, prompts[i], loras[i], cfg.output_len)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(run(i) for i in range(total))))
    return tokens / (time.perf_counter() - t0)


async def measure(url: str, cfg: Config, adapters: dict[str, str], vocab: int) -> dict:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0)) as client:
        for lora in [None, *[f"a{i}" for i in range(1, max(cfg.adapters) + 1)]]:
            await _one(client, [5, 6, 7, 8], lora, 2)
        for n in cfg.adapters:
            await wave(client, cfg, max(cfg.concurrency), n, rng, vocab)
        tput: dict[tuple[int, int], list[float]] = {}
        for _ in range(cfg.runs):
            for conc in cfg.concurrency:
                for n in cfg.adapters:
                    tput.setdefault((conc, n), []).append(await wave(client, cfg, conc, n, rng, vocab))
                    logger.info("concurrency %d, %d adapters: %.1f tok/s", conc, n, tput[(conc, n)][-1])
        loads = []
        extra = f"a{max(cfg.adapters) + 1}"
        for _ in range(cfg.runs):
            t0 = time.perf_counter()
            resp = await client.post("/load_lora_adapter", json={"lora_name": extra, "lora_path": adapters[extra]})
            if resp.status_code != 200:
                raise RuntimeError(f"/load_lora_adapter answered {resp.status_code}: {resp.text[:300]}")
            await _one(client, [5, 6, 7, 8], extra, 1)
            loads.append(time.perf_counter() - t0)
            await client.post("/unload_lora_adapter", json={"lora_name": extra})
    rows = []
    for conc in cfg.concurrency:
        base = statistics.median(tput.get((conc, 0), [float("nan")]))
        for n in cfg.adapters:
            med = statistics.median(tput[(conc, n)])
            rows.append({"concurrency": conc, "adapters": n, "tok_s": med, "runs": tput[(conc, n)],
                         "vs_base": med / base})  # fmt: skip
    return {"rows": rows, "load_s": statistics.median(loads), "load_runs": loads}


def table(result: dict, cfg: Config) -> str:
    lines = [f"shape {cfg.shape}, rank {cfg.rank}, all targets; {cfg.input_len} prompt + {cfg.output_len} output "
             f"tokens; median of {cfg.runs} waves", "| concurrency | adapters | tok/s | vs base |",
             "| ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in result["rows"]:
        lines.append(f"| {r['concurrency']} | {r['adapters']} | {r['tok_s']:.1f} | {r['vs_base']:.2f} |")
    lines.append(f"adapter load (POST /load_lora_adapter + first request): {result['load_s']:.3f} s")
    return "\n".join(lines)


def run(cfg: Config) -> dict:
    model = prepare_model(cfg.shape, cfg.model_dir, "bfloat16", "transformers")
    adapters = ensure_adapters(model, cfg.rank, max(cfg.adapters))
    served = [f"{k}={v}" for k, v in adapters.items() if int(k[1:]) <= max(cfg.adapters)]
    vocab = json.loads((Path(builtin_model_dir() if model == BUILTIN_MODEL else model) / "config.json")
                       .read_text())["vocab_size"]  # fmt: skip
    port = free_port()
    cmd = [sys.executable, str(REPO / "launch.py"), "--model-path", model, "--host", "127.0.0.1", "--port",
           str(port), "--max-running-requests", str(max(cfg.concurrency)), "--max-loras-per-batch", "8",
           "--max-lora-rank", str(max(cfg.rank, 8)), "--enable-lora", "--lora-paths", *served]  # fmt: skip
    os.makedirs(cfg.log_dir, exist_ok=True)
    proc = ManagedProcess("hyssm", cmd, Path(cfg.log_dir) / "hyssm.log", cwd=str(REPO))
    try:
        proc.wait_ready(f"http://127.0.0.1:{port}/health", 900)
        return asyncio.run(measure(f"http://127.0.0.1:{port}", cfg, adapters, min(vocab, 4096)))
    finally:
        proc.stop()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="granite-4.0-h-350m", help="a bench_model_shapes shape, or builtin")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", type=_ints, default=(8, 32))
    p.add_argument("--adapters", type=_ints, default=(0, 1, 4, 8))
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests-per-wave", type=int, default=2, help="requests per wave, per unit of concurrency")
    p.add_argument("--out", default=None)
    p.add_argument("--log-dir", default="bench-logs")
    a = p.parse_args(argv)
    if 0 not in a.adapters:
        p.error("--adapters must include 0 (the base model every row is compared with)")
    return Config(a.shape, a.model_dir, a.rank, a.runs, a.concurrency, a.adapters, a.input_len, a.output_len,
                  a.requests_per_wave, a.out, a.log_dir)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = parse_args(argv)
    result = run(cfg)
    text = table(result, cfg)
    print(text)
    if cfg.out:
        with open(cfg.out, "w", encoding="utf-8") as f:
            json.dump({"config": cfg.__dict__, **result, "table": text}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
