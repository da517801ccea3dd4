"""Servers, prompts and store checks of bench_state_cache.py.

- A `StoreServer` is one ``launch.py`` started in its own process group (peers_procs.ManagedProcess: its
  log file, SIGTERM then SIGKILL of that group only), ready when ``/health`` answers 200; its HTTP calls:
  a non-streaming ``/generate`` timed from send to answer (``max_new_tokens=1`` gives the TTFT),
  ``/flush_cache`` (memory only, or ``include_store``) and a snapshot of the store and cache counters of
  ``/metrics`` (`COUNTERS`), whose differences say which tier served a request; `measure` (one TTFT with
  the counters' growth around it) and `run_round` (prompts one at a time, timed as a whole) build on them.
- Prompts: random ids of the model's vocabulary, never one of its special ids (config.json's bos / eos /
  pad and tokenizer.json's added tokens), each prompt starting with an id no earlier prompt of the run
  started with (while the vocabulary has some left), so two prompts never share a stored block.
- Decode beside a long prefill (`decode_beside_prefill`): a stream of greedy tokens (its chunks' arrival
  times, serving_metrics.apply_chunk) and, once it has streamed `streamed_before` tokens, one long
  prompt of 1 new token; returns the stream and the times the long prompt was sent and answered.
- The store's folder: the entries (files of 64 hex characters in two-character folders under each
  namespace folder) and the temporary files of writes in progress; `wait_written` waits until a
  prompt's entries are on disk (its blocks before the last block end preceding its last token, plus
  the state there; attention-free models write the state only).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.bench_model_shapes import SHAPES
from benchmarks.make_bench_model import make_bench_model
from benchmarks.peers_procs import ManagedProcess, PeerError, free_port
from benchmarks.server_stats import prometheus_sum
from benchmarks.serving_metrics import RequestResult, apply_chunk
from shared.config import BUILTIN_MODEL, builtin_model_dir

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "queried_tokens": ("hyssm_prefix_cache_queried_tokens_total", {}),
    "memory_hit_tokens": ("hyssm_cache_hit_tokens_total", {"tier": "memory"}),
    "store_hit_tokens": ("hyssm_cache_hit_tokens_total", {"tier": "store"}),
    "loads_started": ("hyssm_state_store_loads_total", {"result": "started"}),
    "loads_loaded": ("hyssm_state_store_loads_total", {"result": "loaded"}),
    "loads_failed": ("hyssm_state_store_loads_total", {"result": "failed"}),
    "loaded_tokens": ("hyssm_state_store_loaded_tokens_total", {}),
    "write_drops": ("hyssm_state_store_write_drops_total", {}),
}
_ENTRY = re.compile(r"^[0-9a-f]{64}$")
_TMP_PREFIX = ".tmp-"  # shared/state_store/entry_file.TMP_PREFIX


def _body(ids: list[int], n: int, stream: bool = False) -> dict[str, object]:
    """A greedy /generate of `n` new tokens, EOS ignored."""
    return {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}  # fmt: skip


@dataclass(frozen=True)
class LaunchSpec:
    """What every server of one scenario runs; `pools` and `extra` are launch.py flags (extra last)."""

    model: str
    dtype: str
    device: str
    store_dir: str | None
    store_gb: float
    block_tokens: int
    pools: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()

    def command(self, port: int) -> list[str]:
        cmd = [sys.executable, str(REPO / "launch.py"), "--model-path", self.model, "--dtype", self.dtype,
               "--device", self.device, "--host", "127.0.0.1", "--port", str(port), *self.pools]  # fmt: skip
        if self.store_dir:
            cmd += ["--state-cache-dir", self.store_dir, "--state-cache-size-gb", str(self.store_gb),
                    "--state-cache-block-tokens", str(self.block_tokens),
                    "--hicache-write-policy", "write_through"]  # fmt: skip
        return cmd + list(self.extra)


class StoreServer:
    """One started launch.py (see the module doc); stop() is idempotent."""

    def __init__(self, name: str, spec: LaunchSpec, log_dir: Path, ready_timeout_s: float,
                 request_timeout_s: float) -> None:  # fmt: skip
        port = free_port()
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.proc = ManagedProcess(name, spec.command(port), log_dir / f"{name}.log", cwd=str(REPO))
        try:
            logger.info("%s ready in %.1fs", name, self.proc.wait_ready(f"{self.url}/health", ready_timeout_s))
        except BaseException:
            self.proc.stop()
            raise
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(request_timeout_s, connect=30.0))

    def generate(self, ids: list[int], max_new_tokens: int = 1) -> tuple[float, dict[str, object]]:
        """(seconds from send to answer, meta_info) of one greedy /generate, EOS ignored."""
        t0 = time.perf_counter()
        resp = self.client.post("/generate", json=_body(ids, max_new_tokens))
        took = time.perf_counter() - t0
        if resp.status_code != 200:
            raise PeerError(f"{self.name}: /generate answered {resp.status_code}: {resp.text[:300]}")
        return took, resp.json()["meta_info"]

    def measure(self, ids: list[int]) -> dict[str, float]:
        """One TTFT request (1 new token): its seconds, cached_tokens and the counters' growth around it."""
        before = self.counters()
        took, meta = self.generate(ids)
        return {"ttft_s": took, "cached_tokens": float(meta.get("cached_tokens", 0)),  # type: ignore[arg-type]
                **counters_delta(before, self.counters())}  # fmt: skip

    def run_round(self, batch: list[list[int]]) -> dict[str, float]:
        """The prompts one at a time (1 new token each): seconds, requests, prompt and cached tokens, counters."""
        before, cached, t0 = self.counters(), 0, time.perf_counter()
        for ids in batch:
            _, meta = self.generate(ids)
            cached += int(meta.get("cached_tokens", 0))  # type: ignore[call-overload]
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "requests": len(batch), "prompt_tokens": sum(len(ids) for ids in batch),
                "cached_tokens": cached, **counters_delta(before, self.counters())}  # fmt: skip

    def flush(self, include_store: bool = False, attempts: int = 20) -> None:
        """POST /flush_cache; a refusal (a step still in flight) is retried every 0.5 s."""
        query = "?include_store=true" if include_store else ""
        for _ in range(attempts):
            resp = self.client.post(f"/flush_cache{query}")
            if resp.status_code == 200:
                return
            logger.info("%s: /flush_cache%s refused (%s), retrying", self.name, query, resp.text[:200])
            time.sleep(0.5)  # the scheduler refuses while a step is in flight: wait it out
        raise PeerError(f"{self.name}: /flush_cache{query} refused {attempts} times: {resp.text[:300]}")

    def counters(self) -> dict[str, float]:
        """The COUNTERS now (0.0 for one the server does not expose)."""
        resp = self.client.get("/metrics")
        resp.raise_for_status()
        return {k: prometheus_sum(resp.text, name, **labels) or 0.0 for k, (name, labels) in COUNTERS.items()}

    def stop(self) -> None:
        self.client.close()
        self.proc.stop()


async def _stream(client: httpx.AsyncClient, ids: list[int], n: int, res: RequestResult, going: asyncio.Event,
                  streamed_before: int) -> None:  # fmt: skip
    """Stream `n` tokens of `ids` into `res`; sets `going` once `streamed_before` arrived (or the stream ended)."""
    res.start = time.perf_counter()
    try:
        async with client.stream("POST", "/generate", json=_body(ids, n, stream=True)) as resp:
            if resp.status_code != 200:
                raise PeerError(f"stream answered {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                data = line[len("data:") :].strip() if line.startswith("data:") else ""
                if data == "[DONE]":
                    break
                if data:
                    apply_chunk("hyssm", json.loads(data), res, time.perf_counter())
                    if res.completion_tokens >= streamed_before:
                        going.set()
        res.end, res.success = time.perf_counter(), True
    finally:
        going.set()


async def decode_beside_prefill(url: str, decode_ids: list[int], decode_tokens: int, long_ids: list[int],
                                streamed_before: int, timeout_s: float, written: Callable[[], bool] | None = None,
                                ) -> tuple[RequestResult, float, float, float]:  # fmt: skip
    """(the stream, when the long prompt was sent, when it was answered, when its entries were stored:
    `written` polled every 20 ms from the answer on while the stream runs; the answer without it)."""
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        res, going = RequestResult(prompt_tokens=len(decode_ids)), asyncio.Event()
        task = asyncio.create_task(_stream(client, decode_ids, decode_tokens, res, going, streamed_before))
        await going.wait()
        if task.done():
            task.result()  # raises what the stream raised
        sent = time.perf_counter()
        resp = await client.post("/generate", json=_body(long_ids, 1))
        answered = stored = time.perf_counter()
        while written is not None and not task.done() and not await asyncio.to_thread(written):
            await asyncio.sleep(0.02)  # polling the store folder while the decode streams
        stored = time.perf_counter() if written is not None else answered
        await task
    if resp.status_code != 200:
        raise PeerError(f"the long prompt answered {resp.status_code}: {resp.text[:300]}")
    return res, sent, answered, stored


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


# ---------------------------------------------------------------- model and prompts


def prepare_model(shape: str, model_dir: str | None, dtype: str, init: str) -> str:
    """The checkpoint to serve: "builtin", or `model_dir` (default: a cache folder named by shape, dtype and
    init) written by make_bench_model unless it already holds one of `shape`."""
    if shape == BUILTIN_MODEL:
        return BUILTIN_MODEL
    if model_dir is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hyssm" / "bench-models"
        model_dir = str(cache / f"{shape}-{dtype}-{init}")
    config = Path(model_dir) / "config.json"
    if config.is_file():
        have, want = json.loads(config.read_text()), SHAPES[shape]
        keys = ("hidden_size", "num_hidden_layers", "num_local_experts", "vocab_size")
        if any(have.get(k) != want.get(k) for k in keys):
            raise ValueError(f"{model_dir} holds another shape than {shape} (compare {', '.join(keys)})")
        logger.info("using the %s checkpoint in %s", shape, model_dir)
    else:
        logger.info("writing a %s checkpoint (%s, %s init) to %s", shape, dtype, init, model_dir)
        make_bench_model(model_dir, shape, dtype=dtype, init=init)
    return model_dir


def model_ids(model: str) -> tuple[int, set[int], bool]:
    """(vocab size, special ids, whether the model has attention layers) of a checkpoint."""
    folder = Path(builtin_model_dir() if model == BUILTIN_MODEL else model)
    cfg = json.loads((folder / "config.json").read_text())
    banned = {int(cfg[k]) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if isinstance(cfg.get(k), int)}
    tok = folder / "tokenizer.json"
    if tok.is_file():
        banned |= {int(t["id"]) for t in json.loads(tok.read_text()).get("added_tokens", [])}
    kinds = cfg.get("layer_types")
    has_attention = not isinstance(kinds, list) or any("attention" in str(k) for k in kinds)
    return int(cfg["vocab_size"]), banned, has_attention


class PromptSource:
    """Random prompts of a vocabulary (see the module doc); deterministic for a seed."""

    def __init__(self, vocab: int, banned: set[int], seed: int) -> None:
        self.ids = [t for t in range(vocab) if t not in banned]
        self.rng = random.Random(seed)
        self.firsts: set[int] = set()

    def draw(self, n: int) -> list[int]:
        fresh = [t for t in self.ids if t not in self.firsts] or self.ids
        first = self.rng.choice(fresh)
        self.firsts.add(first)
        return [first, *(self.rng.choice(self.ids) for _ in range(n - 1))]


# ---------------------------------------------------------------- the store's folder


def store_files(root: str) -> tuple[int, int]:
    """(entries, temporary files) under a store root (every namespace folder)."""
    entries = temps = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.startswith(_TMP_PREFIX):
                temps += 1
            elif _ENTRY.match(name) and os.path.basename(dirpath) == name[:2]:
                entries += 1
    return entries, temps


def expected_entries(prompt_len: int, block: int, has_attention: bool) -> int:
    """Entries write-through stores for a prompt sharing no block with anything stored."""
    blocks = (prompt_len - 1) // block
    return (blocks if has_attention else 0) + (1 if blocks else 0)


def wait_written(root: str, before: int, expected: int, timeout_s: float, quiet_s: float = 3.0) -> float:
    """Wait until `root` holds `before + expected` entries and no temporary file (or, failing that, has
    grown and not changed for `quiet_s`); returns the seconds waited. Logs a warning at the timeout."""
    t0 = last_change = time.monotonic()
    last = (-1, -1)
    while True:
        now_files = store_files(root)
        entries, temps = now_files
        if temps == 0 and entries >= before + expected:
            return time.monotonic() - t0
        if now_files != last:
            last, last_change = now_files, time.monotonic()
        elif temps == 0 and entries > before and time.monotonic() - last_change > quiet_s:
            logger.warning("store %s: %d new entries, not the %d expected", root, entries - before, expected)
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            logger.warning("store %s: writes not done after %.0fs (%d of %d new entries)", root, timeout_s,
                           entries - before, expected)  # fmt: skip
            return time.monotonic() - t0
        time.sleep(0.1)  # polling period of the folder scan
