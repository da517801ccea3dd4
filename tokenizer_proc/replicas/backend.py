"""`ReplicatedBackend`: the Backend over `--dp-size` replicas, one `SchedulerClient` each.

Rules:
- A request goes to the replica `CacheAwareRouter` picks (tokenizer_proc/replicas/routing.py) among those
  up; its outputs, its abort and its cached_tokens are that replica's. A request sent to a replica
  in the moment it went down ends with that replica's error, as any request in flight there.
- A replica is down when its client is (launch.py sent SchedulerDead for it, or its channel broke):
  its in-flight requests end with an error there (SchedulerClient), its prefix index is forgotten,
  and nothing is routed to it again. The backend is healthy while any replica is up.
- info(): the replicas' SchedulerInfo summed (`merge_infos`: counts and counters added, rates
  recomputed from the sums), counters of a replica that went down kept at their last value (so a
  Prometheus counter never goes back), plus the routing counters; `replicas()` lists each replica.
- flush_cache(): every replica up; succeeds when each one did.
- load_lora() / unload_lora(): every replica up; a load some replica refused is undone on those that took
  it, so the replicas never disagree on which adapters a request may name.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec

from shared.messages import GenerateReq, LoraAdapter, MetricRecord, SchedulerInfo, ServerState, StoreStats, TokenOut
from tokenizer_proc.replicas.routing import CacheAwareRouter, Reason
from tokenizer_proc.replicas.scheduler_client import SchedulerClient
from tokenizer_proc.requests.generation import BackendUnavailable

logger = logging.getLogger(__name__)

_MEAN_FIELDS = frozenset({"new_token_ratio"})
_SAME_FIELDS = frozenset({"radix_cache", "schedule_policy", "context_length"})
_MEAN_GAUGES = frozenset({"hyssm_new_token_ratio"})
_REASONS: tuple[Reason, ...] = ("cache", "load", "balance")


def merge_store_stats(stats: Sequence[StoreStats]) -> StoreStats | None:
    """The replicas' state store counters as one: numbers summed, latencies joined, degraded if any
    replica's is (None when no replica has a store)."""
    if not stats:
        return None
    merged: dict[str, Any] = {}
    for name in StoreStats.__struct_fields__:
        values = [getattr(s, name) for s in stats]
        if isinstance(values[0], bool):
            merged[name] = any(values)
        elif isinstance(values[0], list):
            merged[name] = [x for v in values for x in v]
        else:
            merged[name] = sum(values)
    return StoreStats(**merged)


def merge_states(states: Sequence[ServerState]) -> ServerState:
    """One ServerState for several replicas: counts summed, hit rates recomputed from the summed
    tokens, `batch_is_full` if any replica's is, new_token_ratio averaged, config fields the first's,
    the state stores' counters summed (`merge_store_stats`)."""
    merged: dict[str, Any] = {}
    for name in ServerState.__struct_fields__:
        values = [getattr(s, name) for s in states]
        if name == "state_store":
            merged[name] = merge_store_stats([v for v in values if v is not None])
        elif name in _SAME_FIELDS:
            merged[name] = values[0]
        elif name in _MEAN_FIELDS:
            merged[name] = sum(values) / len(values)
        elif isinstance(values[0], bool):
            merged[name] = any(values)
        else:
            merged[name] = sum(values)
    queried = merged["prefix_queried_tokens"]
    state_hit, kv_only = merged["prefix_state_hit_tokens"], merged["prefix_kv_only_tokens"]
    merged["prefix_state_hit_rate"] = state_hit / queried if queried else 0.0
    merged["prefix_kv_match_rate"] = (state_hit + kv_only) / queried if queried else 0.0
    return ServerState(**merged)


def merge_metrics(live: Sequence[list[MetricRecord]], gone: Sequence[list[MetricRecord]]) -> list[MetricRecord]:
    """Records of the same name and labels added up (ratio gauges averaged); of replicas that are
    gone (`gone`: their last records) only the counters count."""
    first: dict[tuple[str, tuple[tuple[str, str], ...]], MetricRecord] = {}
    total: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
    n: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
    for records, counters_only in [(r, False) for r in live] + [(r, True) for r in gone]:
        for rec in records:
            if counters_only and rec.type == "gauge":
                continue
            key = (rec.name, tuple(sorted(rec.labels.items())))
            first.setdefault(key, rec)
            total[key] += rec.value
            n[key] += 1
    out = []
    for key, rec in first.items():
        value = total[key] / n[key] if rec.name in _MEAN_GAUGES else total[key]
        out.append(msgspec.structs.replace(rec, value=value))
    return out


class ReplicatedBackend:
    """Backend over several SchedulerClients (module docstring). Create inside the event loop,
    `start()`, then `close()` last, as a SchedulerClient."""

    def __init__(self, clients: Sequence[SchedulerClient], router: CacheAwareRouter | None = None) -> None:
        self.clients = list(clients)
        self.router = router or CacheAwareRouter(len(self.clients))
        self.loads = [0] * len(self.clients)
        self.routed: Counter[tuple[int, Reason]] = Counter()
        self._owner: dict[str, int] = {}  # rid -> replica, until its final output or its abort
        self._last: list[SchedulerInfo | None] = [None] * len(self.clients)
        self._forgotten: set[int] = set()

    def start(self) -> None:
        for c in self.clients:
            c.start()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    @property
    def healthy(self) -> bool:
        return bool(self.live())

    def live(self) -> list[int]:
        """Replicas up; forgets the index of each one seen down for the first time."""
        up = []
        for d, c in enumerate(self.clients):
            if c.healthy:
                up.append(d)
            elif d not in self._forgotten:
                self._forgotten.add(d)
                self.router.forget(d)
                logger.error("replica %d is down; routing to replicas %s", d, [
                    i for i, other in enumerate(self.clients) if other.healthy])
        return up

    async def submit(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        live = self.live()
        if not live:
            raise BackendUnavailable("no replica is available")
        decision = self.router.choose(req.input_ids, live, self.loads)
        d = decision.replica
        self.routed[(d, decision.reason)] += 1
        self._owner[req.rid] = d
        self.loads[d] += 1
        finished = False
        try:
            async with contextlib.aclosing(self.clients[d].submit(req)) as outs:  # type: ignore[type-var]
                async for out in outs:
                    finished = out.finished
                    yield out
        finally:
            self.loads[d] -= 1
            if finished and self._owner.get(req.rid) == d:
                del self._owner[req.rid]

    def abort(self, rid: str, reason: str) -> None:
        d = self._owner.pop(rid, None)
        if d is not None:
            self.clients[d].abort(rid, reason)

    def abort_all(self, reason: str) -> int:
        self._owner.clear()
        return sum(c.abort_all(reason) for c in self.clients)

    async def wait_output(self) -> None:
        live = self.live()
        # with no replica up nothing is ever generated: wait until cancelled
        waits = [asyncio.ensure_future(self.clients[d].wait_output()) for d in live] or [
            asyncio.get_running_loop().create_future()]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _each_live(self, what: str, include_store: bool = False) -> dict[int, Any]:
        live = self.live()
        if not live:
            raise BackendUnavailable("no replica is available")
        coros = [self.clients[d].info() if what == "info" else self.clients[d].flush_cache(include_store)
                 for d in live]
        results = await asyncio.gather(*coros, return_exceptions=True)
        answers = {}
        for d, res in zip(live, results, strict=True):
            if isinstance(res, BaseException):
                logger.warning("replica %d did not answer %s: %s", d, what, res)
            else:
                answers[d] = res
        if not answers:
            raise BackendUnavailable(f"no replica answered {what}")
        return answers

    async def replica_infos(self) -> dict[int, SchedulerInfo]:
        """The SchedulerInfo of each replica that answered now (remembered for when it is gone)."""
        infos: dict[int, SchedulerInfo] = await self._each_live("info")
        for d, info in infos.items():
            self._last[d] = info
        return infos

    async def info(self) -> SchedulerInfo:
        return self.merged_info(await self.replica_infos())

    def merged_info(self, infos: dict[int, SchedulerInfo]) -> SchedulerInfo:
        """The replicas' infos as one (module docstring); `infos` from `replica_infos` (not empty)."""
        gone = [info.metrics for d, info in enumerate(self._last) if info is not None and d not in infos]
        metrics = merge_metrics([i.metrics for i in infos.values()], gone) + self._routing_records()
        merged = merge_states([i.server for i in infos.values()])
        steps = [i.in_flight_step for i in infos.values()]
        return SchedulerInfo(server=merged, metrics=metrics, in_flight_step=max(steps))

    def _routing_records(self) -> list[MetricRecord]:
        live = set(self.live())
        out = [MetricRecord(name="hyssm_dp_routed_requests_total", type="counter",
                            help="Requests routed to each --dp-size replica, by reason (cache, load, balance).",
                            labels={"dp_rank": str(d), "reason": r}, value=self.routed[(d, r)])
               for d in range(len(self.clients)) for r in _REASONS]  # fmt: skip
        out += [MetricRecord(name="hyssm_dp_replica_up", type="gauge", help="1 when the replica serves.",
                             labels={"dp_rank": str(d)}, value=int(d in live)) for d in range(len(self.clients))]
        return out

    def health_detail(self) -> dict[str, Any]:
        """The /health body's replica fields: degraded while some replica is down."""
        up = len(self.live())
        return {"degraded": up < len(self.clients), "replicas_up": up, "dp_size": len(self.clients)}

    def replicas(self, infos: dict[int, SchedulerInfo]) -> list[dict[str, Any]]:
        """One entry per replica for /get_server_info: up or not, why not, its load and routing
        counts, and its scheduler's info when it answered (`infos`, from `replica_infos`)."""
        out = []
        for d, c in enumerate(self.clients):
            out.append({
                "dp_rank": d, "up": c.healthy, "error": c.dead_reason, "in_flight_requests": self.loads[d],
                "routed_requests": {r: self.routed[(d, r)] for r in _REASONS},
                "scheduler": infos.get(d),
            })
        return out

    async def flush_cache(self, include_store: bool = False) -> tuple[bool, str]:
        answers: dict[int, tuple[bool, str]] = await self._each_live("flush", include_store)
        for d, (ok, _) in answers.items():
            if ok:
                self.router.forget(d)
        failed = [f"replica {d}: {msg}" for d, (ok, msg) in answers.items() if not ok]
        return (not failed, "; ".join(failed))

    async def _each_up(self, what: str, calls: list[Any]) -> dict[int, tuple[bool, str]]:
        """`calls[d]()` on every live replica d; (ok, message) by replica (one that did not answer: not ok)."""
        live = self.live()
        if not live:
            raise BackendUnavailable("no replica is available")
        results = await asyncio.gather(*(calls[d]() for d in live), return_exceptions=True)
        answers: dict[int, tuple[bool, str]] = {}
        for d, res in zip(live, results, strict=True):
            if isinstance(res, BaseException):
                logger.warning("replica %d did not answer %s: %s", d, what, res)
                answers[d] = (False, f"no answer: {res}")
            else:
                answers[d] = res
        return answers

    @staticmethod
    def _outcome(answers: dict[int, tuple[bool, str]]) -> tuple[bool, str]:
        failed = [msg for ok, msg in answers.values() if not ok]
        if len(answers) == 1 or len(set(failed)) == 1:
            return not failed, failed[0] if failed else ""
        return not failed, "; ".join(f"replica {d}: {msg}" for d, (ok, msg) in answers.items() if not ok)

    async def load_lora(self, adapter: LoraAdapter) -> tuple[bool, str]:
        answers = await self._each_up("load_lora", [functools.partial(c.load_lora, adapter) for c in self.clients])
        ok, message = self._outcome(answers)
        if not ok:
            took = [d for d, (done, _) in answers.items() if done]
            await asyncio.gather(*(self.clients[d].unload_lora(adapter.name) for d in took), return_exceptions=True)
        return ok, message

    async def unload_lora(self, name: str) -> tuple[bool, str]:
        return self._outcome(await self._each_up("unload_lora", [
            functools.partial(c.unload_lora, name) for c in self.clients]))

    def check_integrity(self) -> None:
        assert all(n >= 0 for n in self.loads), self.loads
        assert all(0 <= d < len(self.clients) for d in self._owner.values())
        self.router.check_integrity()
        for c in self.clients:
            c.check_integrity()
