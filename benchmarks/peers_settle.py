"""What bench_peers observes of a running server: whether it is idle (the settle period before each
measured TTFT) and the size of hyssm's pools (what llama-server's context is sized from).

Settle rule (`settle`): poll the server every `poll_s` until
- it reports no generation request running, queued or in flight, in every poll of a window of at
  least `quiet_s` seconds: hyssm's /metrics gauges ``hyssm_num_running_reqs``,
  ``hyssm_num_waiting_reqs`` and ``hyssm_http_in_flight_requests``; llama-server's /metrics
  (``--metrics``) ``llamacpp:requests_processing`` and ``llamacpp:requests_deferred``, else its
  /slots (``is_processing``);
- and, when its process id is given, its process tree used at most `max_cpu` cores over that
  window (a server can still be working after its last response: llama-server finishing a wave's
  slots, a worker's OpenMP threads spinning down, a background write);
a window that fails either test is started afresh. The wait is bounded: PeerError after
`timeout_s` (with what was last seen), never a bare sleep standing in for the condition. A server
that exposes no load and has no pid cannot be observed: PeerError at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import httpx

from benchmarks.peers_procs import PeerError, tree_cpu_seconds
from benchmarks.server_stats import prometheus_sum

logger = logging.getLogger(__name__)

BUSY_GAUGES = (  # each group counts requests on its own (summed); the groups overlap (the largest is taken)
    ("hyssm_num_running_reqs", "hyssm_num_waiting_reqs"),  # the scheduler's batch and queue
    ("hyssm_http_in_flight_requests",),  # the HTTP server's, from arrival to the last byte
    ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
)
KV_CAPACITY = "hyssm_kv_slots_capacity"
STATE_CAPACITY = "hyssm_mamba_slots_capacity"


@dataclass(frozen=True)
class SettleConfig:
    """How quiet a server must be, for how long, and how long to wait for it at most."""

    quiet_s: float = 0.5
    timeout_s: float = 120.0
    max_cpu: float = 0.25  # cores the server's process tree may use during the quiet window
    poll_s: float = 0.05  # polling period of the load probe (not a synchronisation sleep)

    def __post_init__(self) -> None:
        if self.quiet_s < 0 or self.timeout_s <= 0 or self.max_cpu < 0 or self.poll_s <= 0:
            raise ValueError(f"settle: quiet_s, max_cpu >= 0 and timeout_s, poll_s > 0, got {self}")


async def busy_requests(client: httpx.AsyncClient) -> float | None:
    """Generation requests the server reports running, queued or in flight; None when it reports none
    of the known gauges (see the module docstring)."""
    try:
        resp = await client.get("/metrics")
        if resp.status_code == 200:
            counts = []
            for group in BUSY_GAUGES:
                values = [v for g in group if (v := prometheus_sum(resp.text, g)) is not None]
                if values:
                    counts.append(sum(values))
            if counts:
                return max(counts)
    except httpx.HTTPError as e:
        logger.debug("settle: /metrics unreadable: %s", e)
    try:
        resp = await client.get("/slots")
        if resp.status_code == 200 and isinstance(slots := resp.json(), list):
            return float(sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing")))
    except (httpx.HTTPError, ValueError) as e:
        logger.debug("settle: /slots unreadable: %s", e)
    return None


async def settle(client: httpx.AsyncClient, pid: int | None, sc: SettleConfig, what: str) -> dict[str, float]:
    """Wait until the server behind `client` is idle by the module's rule; returns {"settle_s": seconds
    waited in all, "settle_cpu_cores": the tree's CPU use over the quiet window (0 without a pid)}."""
    t0 = time.monotonic()
    window_start: float | None = None
    cpu_start = 0.0
    last = "nothing read yet"
    while True:
        busy = await busy_requests(client)
        now = time.monotonic()
        if busy is None and pid is None:
            raise PeerError(f"{what}: the server reports no load (/metrics, /slots) and has no pid to watch")
        cpu = tree_cpu_seconds(pid) if pid is not None else 0.0
        if busy:
            window_start, last = None, f"{busy:g} request(s) running or queued"
        elif window_start is None:
            window_start, cpu_start = now, cpu
        elif now - window_start >= sc.quiet_s:
            cores = max(0.0, cpu - cpu_start) / max(now - window_start, 1e-9)
            if cores <= sc.max_cpu:
                return {"settle_s": now - t0, "settle_cpu_cores": cores}
            window_start, cpu_start = now, cpu  # idle by its own report, yet working: a new window
            last = f"no request, but its processes used {cores:.2f} cores"
        if now - t0 > sc.timeout_s:
            raise PeerError(f"{what}: the server did not settle within {sc.timeout_s:.0f}s ({last})")
        await asyncio.sleep(sc.poll_s)  # polling period of the probe above


def read_pools(base_url: str, timeout_s: float = 10.0) -> dict[str, int]:
    """hyssm's pool capacities from its /metrics: {"kv_tokens", "state_slots"} (those it reports;
    empty when /metrics cannot be read)."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        logger.warning("no pool sizes from %s/metrics: %s", base_url, e)
        return {}
    out = {}
    for key, name in (("kv_tokens", KV_CAPACITY), ("state_slots", STATE_CAPACITY)):
        if (v := prometheus_sum(text, name)) is not None:
            out[key] = int(v)
    return out

