"""Server-side counters read around one measured run, to set beside what the responses reported.

- ``server_prefix_hit_rate``: the growth of ``hyssm_prefix_cache_hit_tokens_total{kind="state"}`` over
  the growth of ``hyssm_prefix_cache_queried_tokens_total`` on /metrics (a hyssm server sums these over
  its ``--dp-size`` replicas). It equals the response-based ``prefix_cache_hit_rate`` when nothing else
  uses the server meanwhile; NaN when the server has no such counters (another engine, a router).
- ``server_spec_accept_length``: tokens per speculative verify step, 1 + the growth of
  ``hyssm_spec_accepted_tokens_total`` over that of ``hyssm_spec_verify_steps_total`` (NaN when the
  server verified nothing: no ``--speculative-algorithm``, or another engine);
- ``replica_requests``: the requests each replica was sent during the run (``/get_server_info``
  ``replicas[].routed_requests``, all reasons), keyed by dp rank; empty without replicas.

Both are differences of two snapshots, so requests sent before the run (warm-up) do not count.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)

HIT = "hyssm_prefix_cache_hit_tokens_total"
QUERIED = "hyssm_prefix_cache_queried_tokens_total"
VERIFY_STEPS = "hyssm_spec_verify_steps_total"
ACCEPTED = "hyssm_spec_accepted_tokens_total"


@dataclass(frozen=True)
class ServerCounters:
    """One snapshot; None / empty for what the server does not expose."""

    hit_tokens: float | None = None
    queried_tokens: float | None = None
    replica_requests: dict[str, int] = field(default_factory=dict)
    verify_steps: float | None = None
    accepted_drafts: float | None = None


def prometheus_sum(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of `name` that carry `labels` (None when there is none)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
            seen = True
    return total if seen else None


def replica_requests(info: object) -> dict[str, int]:
    """dp rank -> requests routed to it so far, from a /get_server_info document."""
    replicas = info.get("replicas") if isinstance(info, dict) else None
    if not isinstance(replicas, list):
        return {}
    out = {}
    for r in replicas:
        routed = r.get("routed_requests") if isinstance(r, dict) else None
        if isinstance(routed, dict):
            out[str(r.get("dp_rank"))] = int(sum(v for v in routed.values() if isinstance(v, (int, float))))
    return out


async def read_counters(client: httpx.AsyncClient) -> ServerCounters:
    """A snapshot; what cannot be read is left out (logged), never an error."""
    hit = queried = steps = accepted = None
    try:
        resp = await client.get("/metrics")
        resp.raise_for_status()
        hit, queried = prometheus_sum(resp.text, HIT, kind="state"), prometheus_sum(resp.text, QUERIED)
        steps, accepted = prometheus_sum(resp.text, VERIFY_STEPS), prometheus_sum(resp.text, ACCEPTED)
    except httpx.HTTPError as exc:
        logger.info("no /metrics: %s", exc)
    routed: dict[str, int] = {}
    try:
        resp = await client.get("/get_server_info")
        resp.raise_for_status()
        routed = replica_requests(resp.json())
    except (httpx.HTTPError, ValueError) as exc:
        logger.info("no /get_server_info: %s", exc)
    return ServerCounters(hit, queried, routed, steps, accepted)


def counters_delta(before: ServerCounters, after: ServerCounters) -> dict[str, object]:
    """The run's server-side metrics (module docstring) from the snapshots around it."""
    rate = math.nan
    if None not in (before.hit_tokens, after.hit_tokens, before.queried_tokens, after.queried_tokens):
        queried = after.queried_tokens - before.queried_tokens  # type: ignore[operator]
        rate = (after.hit_tokens - before.hit_tokens) / queried if queried > 0 else math.nan  # type: ignore[operator]
    routed = {d: n - before.replica_requests.get(d, 0) for d, n in after.replica_requests.items()}
    accept = math.nan
    if None not in (before.verify_steps, after.verify_steps, before.accepted_drafts, after.accepted_drafts):
        steps = after.verify_steps - before.verify_steps  # type: ignore[operator]
        accept = 1 + (after.accepted_drafts - before.accepted_drafts) / steps if steps > 0 else math.nan  # type: ignore[operator]
    return {"server_prefix_hit_rate": rate, "replica_requests": routed, "server_spec_accept_length": accept}
