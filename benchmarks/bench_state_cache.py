"""The persistent state store (``--state-cache-dir``, write-through) against prefill: TTFT per tier, a working
set larger than memory, and what the background writer costs a running decode.

    python benchmarks/bench_state_cache.py --out state_cache.json                   # 350M shape, 4k and 16k
    python benchmarks/bench_state_cache.py --shape granite-4.0-h-tiny --lengths 4096,16384   # the MoE shape
    python benchmarks/bench_state_cache.py --shape builtin --lengths 512 --ws-len 512   # smoke test, minutes

The checkpoint: ``--shape builtin`` is the shipped tiny model; a Granite-4.0-H shape (bench_model_shapes.py)
is written once by make_bench_model.py (``--dtype bfloat16 --init transformers`` by default) to ``--model-dir``
(default ``$XDG_CACHE_HOME/hyssm/bench-models/SHAPE-DTYPE-INIT``) and reused. Every server is ``launch.py`` on a
free loopback port in its own process group (stopped, that group only, at the end, on error, Ctrl-C and
SIGTERM); with the store: ``--state-cache-dir --state-cache-size-gb --state-cache-block-tokens
--hicache-write-policy write_through``. The store lives in a temporary folder (removed at the end) or under
``--store-dir`` (kept; its TTFT folder is emptied first with ``/flush_cache?include_store=true``).
``--server-args`` go last on every command line (they override the pool flags below). Logs: ``--log-dir``.

TTFT = seconds from sending a non-streaming ``/generate`` of ``max_new_tokens=1`` (greedy, EOS ignored) to its
answer. Per ``--lengths`` L and ``--repeats`` fresh random prompts P (medians, and the ratio to cold), two
servers A and B on one store folder (B started once A is ready; each warmed up with an unrelated prompt of the
shortest L and one of 64 tokens, the shape of a hit's uncached tail; pools: ``--max-running-requests 4
--max-total-tokens 3*(max L + 2B) --max-mamba-cache-size 8``):
  cold: A's memory flushed, P (nothing of it stored);  memory: P again on A;
  store (same server): once P's entries are on disk, A's memory flushed (``/flush_cache``), P again;
  store (other replica): P on B, which never saw it;
  store (after restart): after all of the above, per P: A stopped, a new A started on the folder, one
  unrelated 64-token request, then P.
Each row also gives the median ``cached_tokens`` and the store loads counted on /metrics around its requests.

Working set (``--ws-prefixes`` K prefixes of ``--ws-len`` tokens, ``--ws-rounds`` R): pools of
``--max-running-requests 1 --max-total-tokens K*(len+suffix)/--ws-pool-ratio --max-mamba-cache-size
--ws-state-slots``, so the prefixes exceed the KV pool ``--ws-pool-ratio`` times (and the state pool K/slots
times). One round sends each prefix plus a distinct ``--ws-suffix``-token suffix in turn, one request at a time.
A server without and one with the store, both up: each gets a fill round, then their R measured rounds
alternate (no store first, then store first, ...; a machine whose speed drifts meets both alike). Per server: the
share of queried prompt
tokens served from a cache tier (``hyssm_cache_hit_tokens_total`` by tier over
``hyssm_prefix_cache_queried_tokens_total``), requests/s and prompt tokens/s, and store / no store.

Writer drain: a 64-token prompt streams ``--decode-tokens`` tokens; once it has streamed 8, a ``--drain-len``
token prompt (default: the longest L) is sent (1 new token); its prefill runs beside the decode and, with the
store, its entries are then written in the background while the decode goes on. Inter-token latencies of the
stream (serving_metrics.itls_from_chunks): p50 / p99 of all of them, of those after the long prompt was sent,
of those after it was answered, of those while its entries were written (until they are all in the folder, polled
every 20 ms) and of those after; the long prefill's and the writes' seconds. The writer's cost is the store
server's "while written" against its own "after" (one server, one process: instances of the same server differ
by more than 10 % in decode speed on a shared machine). A server without and one
with the store, both up, each warmed up with one such case, then ``--repeats`` cases alternating between them
(the store's entries on disk before the next case). Medians; store / no store.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a file: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_model_shapes import SHAPES  # noqa: E402
from benchmarks.make_bench_model import DTYPES, INITS  # noqa: E402
from benchmarks.peers_procs import PeerError, stop_on_sigterm  # noqa: E402
from benchmarks.serving_metrics import json_safe  # noqa: E402
from benchmarks.state_cache_report import SCENARIOS, format_report, itl_windows, summarize, ws_totals  # noqa: E402
from benchmarks.state_cache_servers import (  # noqa: E402
    LaunchSpec,
    PromptSource,
    StoreServer,
    decode_beside_prefill,
    expected_entries,
    model_ids,
    prepare_model,
    store_files,
    wait_written,
)
from shared.config import BUILTIN_MODEL  # noqa: E402

logger = logging.getLogger(__name__)

PARTS = ("ttft", "working-set", "drain")
SETTLE_LEN = 64  # the unrelated request a restarted server gets before the measured one
DECODE_PROMPT_LEN = 64
STREAMED_BEFORE_PREFILL = 8


@dataclasses.dataclass(frozen=True)
class Config:
    shape: str = "granite-4.0-h-350m"
    model_dir: str | None = None
    dtype: str | None = None  # None: bfloat16 for a written checkpoint, the model's own (auto) for builtin
    init: str = "transformers"
    device: str = "auto"
    lengths: tuple[int, ...] = (4096, 16384)
    repeats: int = 3
    block_tokens: int = 64
    store_gb: float = 16.0
    parts: tuple[str, ...] = PARTS
    ws_prefixes: int = 8
    ws_len: int = 4096
    ws_suffix: int = 32
    ws_rounds: int = 3
    ws_pool_ratio: float = 4.0
    ws_state_slots: int = 2
    decode_tokens: int = 256
    drain_len: int = 0  # 0: max(lengths)
    server_args: tuple[str, ...] = ()
    store_dir: str | None = None
    log_dir: str | None = None
    seed: int = 0
    ready_timeout_s: float = 900.0
    request_timeout_s: float = 3600.0
    write_timeout_s: float = 600.0
    out: str | None = None


@dataclasses.dataclass
class Bench:
    """What every part shares: the config, the checkpoint, the prompt source and the folders."""

    cfg: Config
    model: str
    dtype: str
    prompts: PromptSource
    has_attention: bool
    store_root: Path
    log_dir: Path
    stack: contextlib.ExitStack

    def spec(self, store: str | None, pools: Sequence[str]) -> LaunchSpec:
        return LaunchSpec(self.model, self.dtype, self.cfg.device, store, self.cfg.store_gb, self.cfg.block_tokens,
                          tuple(pools), self.cfg.server_args)  # fmt: skip

    def start(self, name: str, spec: LaunchSpec) -> StoreServer:
        server = StoreServer(name, spec, self.log_dir, self.cfg.ready_timeout_s, self.cfg.request_timeout_s)
        self.stack.callback(server.stop)  # stop() is idempotent: a server stopped early is stopped again harmlessly
        return server

    def start_pair(self, name: str, pools: Sequence[str]) -> dict[str, tuple[StoreServer, Path | None]]:
        """A server without the store and one with it (in the folder `name` of the store root), one after the
        other: {"no_store": (server, None), "store": (server, folder)}."""
        folder = self.store_root / name
        return {"no_store": (self.start(f"{name}-no_store", self.spec(None, pools)), None),
                "store": (self.start(f"{name}-store", self.spec(str(folder), pools)), folder)}  # fmt: skip

    def wait_written(self, folder: Path, before: int, prompt_lens: Sequence[int]) -> None:
        want = sum(expected_entries(n, self.cfg.block_tokens, self.has_attention) for n in prompt_lens)
        waited = wait_written(str(folder), before, want, self.cfg.write_timeout_s)
        logger.info("store writes on disk after %.2fs", waited)


# ---------------------------------------------------------------- 1-5: TTFT by tier


def ttft_part(b: Bench) -> dict[int, dict[str, list[dict[str, float]]]]:
    """Per length and scenario, one record of StoreServer.measure per repeat (see the module doc)."""
    cfg, folder = b.cfg, b.store_root / "ttft"
    longest = max(cfg.lengths)
    pools = ("--max-running-requests", "4", "--max-total-tokens", str(3 * (longest + 2 * cfg.block_tokens)),
             "--max-mamba-cache-size", "8")  # fmt: skip
    spec = b.spec(str(folder), pools)
    prompts = {n: [b.prompts.draw(n) for _ in range(cfg.repeats)] for n in cfg.lengths}
    out = {n: {s: [] for s in SCENARIOS} for n in cfg.lengths}
    a = b.start("ttft-a", spec)
    a.flush(include_store=True)
    replica = b.start("ttft-b", spec)
    for server in (a, replica):  # warm-up: unrelated prompts, their writes on disk before anything is measured
        before = store_files(str(folder))[0]
        server.generate(b.prompts.draw(min(cfg.lengths)), 2)
        server.generate(b.prompts.draw(SETTLE_LEN), 1)  # as a restarted server gets: the short tails' shapes
        b.wait_written(folder, before, [min(cfg.lengths), SETTLE_LEN])
    for n in cfg.lengths:
        for k, p in enumerate(prompts[n]):
            logger.info("TTFT, %d tokens, prompt %d/%d: cold, memory, store", n, k + 1, cfg.repeats)
            before = store_files(str(folder))[0]
            a.flush()
            out[n]["cold"].append(a.measure(p))
            out[n]["memory"].append(a.measure(p))
            b.wait_written(folder, before, [n])
            a.flush()
            out[n]["store_same_server"].append(a.measure(p))
            out[n]["store_other_replica"].append(replica.measure(p))
    restarts = 0
    for n in cfg.lengths:
        for p in prompts[n]:
            a.stop()
            restarts += 1
            logger.info("TTFT, %d tokens: restart %d", n, restarts)
            a = b.start(f"ttft-a-restart{restarts}", spec)
            a.generate(b.prompts.draw(SETTLE_LEN), 1)
            out[n]["store_after_restart"].append(a.measure(p))
    a.stop()
    replica.stop()
    return out


# ---------------------------------------------------------------- 6: a working set larger than memory


def ws_pools(cfg: Config) -> tuple[str, ...]:
    prompt = cfg.ws_len + cfg.ws_suffix
    kv = max(int(cfg.ws_prefixes * prompt / cfg.ws_pool_ratio), prompt + 2 * cfg.block_tokens)
    return ("--max-running-requests", "1", "--max-total-tokens", str(kv),
            "--max-mamba-cache-size", str(cfg.ws_state_slots))  # fmt: skip


def working_set_part(b: Bench) -> dict[str, object]:
    """The same rounds on a server without and one with the store, both up, their rounds alternating."""
    cfg = b.cfg
    prefixes = [b.prompts.draw(cfg.ws_len) for _ in range(cfg.ws_prefixes)]
    rounds = [[p + b.prompts.draw(cfg.ws_suffix) for p in prefixes] for _ in range(cfg.ws_rounds + 1)]
    pools = ws_pools(cfg)
    kv_slots = int(pools[pools.index("--max-total-tokens") + 1])
    out: dict[str, object] = {
        "pools": " ".join(pools),
        "working_set_tokens": cfg.ws_prefixes * (cfg.ws_len + cfg.ws_suffix),
        "kv_ratio": cfg.ws_prefixes * (cfg.ws_len + cfg.ws_suffix) / kv_slots,
        "state_ratio": cfg.ws_prefixes / cfg.ws_state_slots,
    }
    servers = b.start_pair("ws", pools)
    for server, folder in servers.values():  # warm-up and the fill round, its writes on disk
        server.generate(b.prompts.draw(SETTLE_LEN), 2)
        before = store_files(str(folder))[0] if folder else 0
        for ids in rounds[0]:
            server.generate(ids)
        if folder:
            b.wait_written(folder, before, [len(ids) for ids in rounds[0]])
    measured: dict[str, list[dict[str, float]]] = {label: [] for label in servers}
    for k, batch in enumerate(rounds[1:]):
        for label in alternate(list(servers), k):
            logger.info("%s: working set round %d/%d", label, k + 1, cfg.ws_rounds)
            measured[label].append(servers[label][0].run_round(batch))
    for label, server_folder in servers.items():
        server_folder[0].stop()
        out[label] = ws_totals(measured[label])
    return out


def alternate(labels: list[str], k: int) -> list[str]:
    """The order of the k-th paired run: reversed every other time, so neither server always goes first."""
    return labels if k % 2 == 0 else labels[::-1]


# ---------------------------------------------------------------- 7: decode latency while the writer drains


def written_all(folder: str, want: int) -> bool:
    entries, temps = store_files(folder)
    return entries >= want and temps == 0


def drain_once(server: StoreServer, decode_ids: list[int], long_ids: list[int], cfg: Config,
               written: Callable[[], bool] | None) -> dict[str, float]:  # fmt: skip
    run = decode_beside_prefill(server.url, decode_ids, cfg.decode_tokens, long_ids, STREAMED_BEFORE_PREFILL,
                                cfg.request_timeout_s, written)  # fmt: skip
    res, sent, answered, stored = asyncio.run(run)
    out = {"prefill_s": answered - sent, "write_s": stored - answered,
           **itl_windows(res.chunks, sent, answered, stored)}
    if out["drain_tokens"] < 16:
        logger.warning("%s: only %d tokens streamed after the long prompt was answered: raise --decode-tokens",
                       server.name, out["drain_tokens"])  # fmt: skip
    return out


def drain_part(b: Bench) -> dict[str, list[dict[str, float]]]:
    """Per server (no store, store: both up, their cases alternating) one record of drain_once per case."""
    cfg = b.cfg
    n = cfg.drain_len or max(cfg.lengths)
    warm = (b.prompts.draw(DECODE_PROMPT_LEN), b.prompts.draw(min(n, 1024)))
    cases = [(b.prompts.draw(DECODE_PROMPT_LEN), b.prompts.draw(n)) for _ in range(cfg.repeats)]
    kv = 2 * (n + DECODE_PROMPT_LEN + cfg.decode_tokens + 2 * cfg.block_tokens)
    servers = b.start_pair("drain", ("--max-running-requests", "4", "--max-total-tokens", str(kv),
                                     "--max-mamba-cache-size", "8"))  # fmt: skip
    out: dict[str, list[dict[str, float]]] = {label: [] for label in servers}
    for k, (decode_ids, long_ids) in enumerate([warm, *cases]):
        for label in alternate(list(servers), k):
            server, folder = servers[label]
            logger.info("%s: %s", server.name, f"case {k}/{len(cases)}" if k else "warm-up")
            before = store_files(str(folder))[0] if folder else 0
            want = before + expected_entries(len(long_ids), cfg.block_tokens, b.has_attention)
            written = (lambda f=str(folder), w=want: written_all(f, w)) if folder else None
            res = drain_once(server, decode_ids, long_ids, cfg, written)
            if folder:  # this case's writes are done before the next run starts
                b.wait_written(folder, before, [len(decode_ids), len(long_ids)])
            if k:
                out[label].append(res)
    for server, _ in servers.values():
        server.stop()
    return out


# ---------------------------------------------------------------- CLI


def run(cfg: Config) -> dict[str, object]:
    """Every part of cfg.parts; the raw records, their summary and the config."""
    dtype = cfg.dtype or ("auto" if cfg.shape == BUILTIN_MODEL else "bfloat16")
    model = prepare_model(cfg.shape, cfg.model_dir, "bfloat16" if dtype == "auto" else dtype, cfg.init)
    vocab, banned, has_attention = model_ids(model)
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="bench_state_cache_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logger.info("server logs in %s", log_dir)
    t0 = time.perf_counter()
    doc: dict[str, object] = {"config": {**dataclasses.asdict(cfg), "model": model, "dtype": dtype}}
    with contextlib.ExitStack() as stack:
        root = cfg.store_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="hyssm-state-store-"))
        b = Bench(cfg, model, dtype, PromptSource(vocab, banned, cfg.seed), has_attention, Path(root), log_dir, stack)
        if "ttft" in cfg.parts:
            doc["ttft"] = ttft_part(b)
        if "working-set" in cfg.parts:
            doc["working_set"] = working_set_part(b)
        if "drain" in cfg.parts:
            doc["drain"] = drain_part(b)
    doc["elapsed_s"] = time.perf_counter() - t0
    doc["summary"] = summarize(doc)
    return doc


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--shape", choices=(*sorted(SHAPES), BUILTIN_MODEL), default=Config.shape,
      help="a Granite-4.0-H shape (granite-4.0-h-tiny: the MoE one) or the shipped tiny model")
    a("--model-dir", default=None, help="where the shape's checkpoint is (written there when absent)")
    a("--dtype", choices=sorted(DTYPES), default=None, help="checkpoint and server dtype (default: bfloat16; builtin: "
      "its own)")
    a("--init", choices=INITS, default=Config.init, help="make_bench_model.py --init of a written checkpoint")
    a("--device", default=Config.device, help="launch.py --device (auto, cpu, cuda)")
    a("--lengths", type=_ints, default=Config.lengths, help="TTFT prompt lengths, comma-separated")
    a("--repeats", type=int, default=Config.repeats, help="fresh prompts per TTFT row and drain cases (medians)")
    a("--block-tokens", type=int, default=Config.block_tokens, help="--state-cache-block-tokens")
    a("--store-gb", type=float, default=Config.store_gb, help="--state-cache-size-gb")
    a("--parts", default=",".join(PARTS), help=f"which parts to run, comma-separated: {', '.join(PARTS)}")
    a("--ws-prefixes", type=int, default=Config.ws_prefixes)
    a("--ws-len", type=int, default=Config.ws_len)
    a("--ws-suffix", type=int, default=Config.ws_suffix, help="at most --block-tokens (the stored state then ends "
      "where the prefix does)")
    a("--ws-rounds", type=int, default=Config.ws_rounds, help="measured rounds after the fill round")
    a("--ws-pool-ratio", type=float, default=Config.ws_pool_ratio, help="working set tokens / KV pool tokens")
    a("--ws-state-slots", type=int, default=Config.ws_state_slots, help="--max-mamba-cache-size of the working set")
    a("--decode-tokens", type=int, default=Config.decode_tokens)
    a("--drain-len", type=int, default=0, help="the prompt prefilled beside the decode (default: the longest length)")
    a("--server-args", default="", help="extra launch.py flags for every server, one string (go last)")
    a("--store-dir", default=None, help="store root (default: a temporary folder, removed at the end)")
    a("--log-dir", default=None, help="server logs (default: a temporary folder, kept)")
    a("--seed", type=int, default=0)
    a("--ready-timeout", dest="ready_timeout_s", type=float, default=Config.ready_timeout_s)
    a("--request-timeout", dest="request_timeout_s", type=float, default=Config.request_timeout_s)
    a("--write-timeout", dest="write_timeout_s", type=float, default=Config.write_timeout_s,
      help="seconds to wait for a prompt's entries to be on disk")
    a("--out", default=None, metavar="JSON")
    a("--log-level", default="INFO")
    ns = p.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    del ns.log_level
    ns.parts = tuple(x.strip() for x in ns.parts.split(",") if x.strip())
    if not ns.parts or set(ns.parts) - set(PARTS):
        p.error(f"--parts must name some of {', '.join(PARTS)}")
    if not ns.lengths or min(ns.lengths) < 2:
        p.error("--lengths must be integers >= 2")
    for name in ("repeats", "block_tokens", "ws_prefixes", "ws_len", "ws_suffix", "ws_rounds", "ws_state_slots",
                 "decode_tokens"):  # fmt: skip
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if ns.decode_tokens <= STREAMED_BEFORE_PREFILL or ns.ws_pool_ratio <= 0:
        p.error(f"need --decode-tokens > {STREAMED_BEFORE_PREFILL} and --ws-pool-ratio > 0")
    if ns.ws_suffix > ns.block_tokens:
        logger.warning("--ws-suffix > --block-tokens: the stored states end past the prefixes; fewer hits")
    ns.server_args = tuple(shlex.split(ns.server_args))
    return Config(**vars(ns))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the tables (and write JSON with --out); exit 1 when a server failed."""
    cfg = parse_args(argv)
    try:
        with stop_on_sigterm():
            doc = run(cfg)
    except (PeerError, httpx.HTTPError, ValueError) as e:
        logger.error("%s (every server it started was stopped)", e)
        return 1
    except KeyboardInterrupt:
        logger.error("interrupted (every server it started was stopped)")
        return 130
    print(format_report(doc))
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(json_safe(doc), indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
