"""Soak benchmark: mixed traffic in waves for N minutes, per-process memory and fds after each wave,
then a verdict on whether each process's memory plateaus or keeps growing.

    python benchmarks/soak.py --minutes 22 --out /tmp/soak.json                 # starts the built-in model
    python benchmarks/soak.py --minutes 30 --model-path /models/x -- --device cuda --tp-size 2
    python benchmarks/soak.py --url http://127.0.0.1:30000 --pid 4242 --minutes 10

Flags after ``--`` go to launch.py. With ``--url`` the server is not started; its processes are the
launcher ``--pid`` and its descendants (without ``--pid``: the process listening on the URL's port,
walked up to its launcher, which needs psutil). The traffic is soak_traffic.py's mix;
the samples are soak_procs.py's (VmRSS / RssAnon / RssFile and open fds of every process).

Waves: ``--wave-requests`` requests at most ``--concurrency`` in flight; a new wave starts while
less than ``--minutes`` have passed (and fewer than ``--max-waves`` ran). Wave 0 is the sample taken
before any traffic. Verdict, per process: the least-squares slope of its VmRSS over the last half of
the waves (at least 3 points) against ``--growth-mb-per-wave`` (and of its fd count against
``--growth-fds-per-wave``): ``growth`` above either threshold, else ``plateau``; fewer points give
``insufficient``. The overall verdict is ``growth`` if any process grows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a file (python benchmarks/soak.py): make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peers_procs import ManagedProcess, free_port, stop_on_sigterm  # noqa: E402
from benchmarks.soak_procs import ProcSample, listener_pid, sample_server  # noqa: E402
from benchmarks.soak_traffic import WaveTally, draw_request, prefix_texts, send  # noqa: E402

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent


def slope(ys: Sequence[float]) -> float:
    """Least-squares slope of ys against 0, 1, 2, ... (0.0 for fewer than two points)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2.0, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in range(n))
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sxx


def verdict(waves: list[dict[str, object]], mb_per_wave: float, fds_per_wave: float) -> dict[str, object]:
    """Per-process and overall plateau/growth decision over the last half of the waves (see module doc)."""
    series: dict[str, dict[str, object]] = {}
    for wave in waves:
        for p in wave["processes"]:  # type: ignore[union-attr]
            entry = series.setdefault(p["name"], {"kind": p["kind"], "rss_mb": [], "fds": []})
            entry["rss_mb"].append(p["rss_mb"])  # type: ignore[union-attr]
            entry["fds"].append(p["fds"])  # type: ignore[union-attr]
    out: dict[str, dict[str, object]] = {}
    for name, s in series.items():
        rss, fds = s["rss_mb"], s["fds"]
        tail = len(rss) // 2  # type: ignore[arg-type]
        last_rss, last_fds = rss[-tail:] if tail else [], fds[-tail:] if tail else []  # type: ignore[index]
        rs, fs = slope(last_rss), slope(last_fds)
        decided = "insufficient" if len(last_rss) < 3 else (
            "growth" if rs > mb_per_wave or fs > fds_per_wave else "plateau")  # fmt: skip
        out[name] = {"kind": s["kind"], "first_rss_mb": rss[0], "last_rss_mb": rss[-1],  # type: ignore[index]
                     "slope_mb_per_wave": rs, "slope_fds_per_wave": fs, "window_waves": len(last_rss),
                     "verdict": decided}  # fmt: skip
    decisions = {v["verdict"] for v in out.values()}
    overall = "growth" if "growth" in decisions else "insufficient" if "insufficient" in decisions else "plateau"
    return {"threshold_mb_per_wave": mb_per_wave, "threshold_fds_per_wave": fds_per_wave,
            "overall": overall, "processes": out}  # fmt: skip


def wave_line(wave: dict[str, object]) -> str:
    """The one line printed after a wave: outcomes, then name=RSS MB[anon shmem file]/fds of every process."""
    procs = sorted(wave["processes"], key=lambda p: p["name"])  # type: ignore[arg-type]
    mem = " ".join(f"{p['name']}={p['rss_mb']:.0f}MB[a{p['rss_anon_mb']:.0f} s{p['rss_shmem_mb']:.0f} "
                   f"f{p['rss_file_mb']:.0f}]/{p['fds']}fd" for p in procs)  # fmt: skip
    tally = wave.get("outcomes", {})
    done = {k: sum(c[k] for c in tally.values()) for k in ("ok", "cut", "failed")}  # type: ignore[union-attr]
    return (f"wave {wave['wave']:3d} t={wave['elapsed_s']:7.1f}s ok={done['ok']} cut={done['cut']} "
            f"failed={done['failed']} | {mem}")  # fmt: skip


async def run_wave(client: httpx.AsyncClient, rng: random.Random, model: str, prefixes: list[str],
                   n: int, concurrency: int) -> WaveTally:  # fmt: skip
    """Send n requests of the mix with at most `concurrency` in flight; their outcomes."""
    tally = WaveTally()
    sem = asyncio.Semaphore(concurrency)
    reqs = [draw_request(rng, model, prefixes) for _ in range(n)]

    async def one(req: object) -> None:
        async with sem:
            await send(client, req, tally)  # type: ignore[arg-type]

    await asyncio.gather(*(one(r) for r in reqs))
    return tally


def _record(index: int, t0: float, samples: list[ProcSample], tally: WaveTally | None,
            duration: float) -> dict[str, object]:  # fmt: skip
    return {"wave": index, "elapsed_s": time.monotonic() - t0, "duration_s": duration,
            "outcomes": tally.counts if tally else {}, "errors": tally.errors if tally else [],
            "processes": [s.to_json() for s in samples]}  # fmt: skip


async def soak(args: argparse.Namespace, url: str, root: int) -> list[dict[str, object]]:
    """The wave loop; returns the wave records (wave 0: before any traffic)."""
    rng = random.Random(args.seed)
    prefixes = prefix_texts(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
    t0 = time.monotonic()
    waves = [_record(0, t0, await settled_sample(root), None, 0.0)]
    print(wave_line(waves[0]), flush=True)
    while time.monotonic() - t0 < args.minutes * 60 or len(waves) == 1:
        if args.max_waves is not None and len(waves) > args.max_waves:
            break
        start = time.monotonic()
        # A client per wave: closing it closes the wave's connections before the sample counts fds.
        async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
            tally = await run_wave(client, rng, model, prefixes, args.wave_requests, args.concurrency)
        duration = time.monotonic() - start
        waves.append(_record(len(waves), t0, await settled_sample(root), tally, duration))
        print(wave_line(waves[-1]), flush=True)
        for err in tally.errors[:3]:
            logger.warning("wave %d: %s", len(waves) - 1, err)
    return waves


async def settled_sample(root: int, period_s: float = 0.2, deadline_s: float = 5.0) -> list[ProcSample]:
    """A sample taken once every process's fd count is the same in two samples `period_s` apart (the
    server closing the connections of the wave that just ended), or the last one after `deadline_s`."""
    end = time.monotonic() + deadline_s
    last = sample_server(root)
    while time.monotonic() < end:
        await asyncio.sleep(period_s)  # sampling period of the poll, not a wait standing in for an event
        now = sample_server(root)
        if {s.pid: s.fds for s in now} == {s.pid: s.fds for s in last}:
            return now
        last = now
    return last


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The soak's flags, and the launch.py flags given after ``--``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    server_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--minutes", type=float, default=20.0, help="keep starting waves while less time than this has passed")
    a("--url", default=None, help="soak a running server instead of starting one")
    a("--pid", type=int, default=None, help="with --url: the server's launcher pid (default: found by port)")
    a("--model-path", default="builtin", help="model of the server started (launch.py --model-path)")
    a("--model", default=None, help="model name in requests (default: first of /v1/models)")
    a("--wave-requests", type=int, default=200)
    a("--concurrency", type=int, default=32)
    a("--max-waves", type=int, default=None, help="stop after this many waves even if time is left")
    a("--growth-mb-per-wave", type=float, default=2.0, help="RSS slope above which a process grows")
    a("--growth-fds-per-wave", type=float, default=0.5, help="fd-count slope above which a process grows")
    a("--seed", type=int, default=0)
    a("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    a("--ready-timeout", type=float, default=300.0, help="seconds to wait for a started server")
    a("--out", default=None, metavar="PATH", help="write the JSON report here")
    a("--log-level", default="WARNING")
    ns = p.parse_args(own)
    if ns.wave_requests < 1 or ns.concurrency < 1 or ns.minutes < 0:
        p.error("need --wave-requests >= 1, --concurrency >= 1, --minutes >= 0")
    return ns, server_flags


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: one line per wave, the verdict, the report with --out. Exit 1 when no request succeeded."""
    args, server_flags = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = None
    if args.url:
        url, root = args.url.rstrip("/"), args.pid or listener_pid(args.url)
        if root is None:
            raise SystemExit("cannot find the server's processes: pass --pid")
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, str(ROOT / "launch.py"), "--model-path", args.model_path, "--port", str(port),
               *server_flags]  # fmt: skip
        log_path = Path(args.out).with_suffix(".server.log") if args.out else Path(f"/tmp/soak-server-{port}.log")
        server = ManagedProcess("hyssm", cmd, log_path, cwd=str(ROOT))
        root = server.proc.pid
    with stop_on_sigterm():
        try:
            if server is not None:
                server.wait_ready(f"{url}/health", args.ready_timeout)
            waves = asyncio.run(soak(args, url, root))
        finally:
            if server is not None:
                server.stop()
    result = verdict(waves, args.growth_mb_per_wave, args.growth_fds_per_wave)
    for name, v in sorted(result["processes"].items()):  # type: ignore[union-attr]
        print(f"{name:>16}: {v['first_rss_mb']:.0f} -> {v['last_rss_mb']:.0f} MB, "
              f"slope {v['slope_mb_per_wave']:+.2f} MB/wave, {v['slope_fds_per_wave']:+.2f} fds/wave "
              f"over the last {v['window_waves']} waves: {v['verdict']}")  # fmt: skip
    print(f"verdict: {result['overall']} (growth = slope > {args.growth_mb_per_wave} MB/wave "
          f"or > {args.growth_fds_per_wave} fds/wave over the last half of the waves)")  # fmt: skip
    config = {**vars(args), "server_flags": server_flags, "url": url, "root_pid": root, "started": server is not None}
    if args.out:
        Path(args.out).write_text(json.dumps({"config": config, "waves": waves, "verdict": result}, indent=2))
    ok = sum(sum(c["ok"] for c in w["outcomes"].values()) for w in waves)  # type: ignore[union-attr]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
