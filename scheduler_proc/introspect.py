"""Read-only views of a Scheduler: the global integrity check, and its SchedulerInfo (the data of
/get_server_info and /metrics). They read the scheduler through `SchedulerState`, the fields a
view may look at (the Scheduler satisfies it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol

from scheduler_proc.batch import InFlight
from scheduler_proc.lora_slots import LoraSlots
from scheduler_proc.metrics import SchedulerMetrics
from scheduler_proc.request import Req, ReqStatus, WaitingQueue
from scheduler_proc.resources import ReqResources
from scheduler_proc.retry import RetryPolicy
from shared.config import ServerArgs
from shared.messages import MetricRecord, SchedulerInfo, ServerState, StoreStats


class SchedulerState(Protocol):
    """What the views read of a scheduler."""

    @property
    def args(self) -> ServerArgs: ...
    @property
    def context_length(self) -> int: ...
    @property
    def in_flight(self) -> InFlight | None: ...
    @property
    def loading(self) -> Mapping[str, Req]: ...
    @property
    def lora(self) -> LoraSlots: ...
    @property
    def max_running(self) -> int: ...
    @property
    def store_stats(self) -> StoreStats | None: ...
    @property
    def metrics(self) -> SchedulerMetrics: ...
    @property
    def new_token_ratio(self) -> float: ...
    @property
    def reqs(self) -> Mapping[str, Req]: ...
    @property
    def res(self) -> ReqResources: ...
    @property
    def retry(self) -> RetryPolicy: ...
    @property
    def reusing(self) -> Mapping[str, Req]: ...
    @property
    def running(self) -> Mapping[str, Req]: ...
    @property
    def track_states(self) -> bool: ...
    @property
    def waiting(self) -> WaitingQueue: ...


def check_scheduler(s: SchedulerState) -> None:
    """Every KV/state slot is free, owned by exactly one running request, or held by one tree node;
    lock counts equal the holds of running requests; waiting requests hold nothing. Raises
    AssertionError naming the first violation."""
    res, cache = s.res, s.res.cache
    res.kv_alloc.check_integrity()
    res.state_alloc.check_integrity()
    cache.check_integrity()
    _check_requests(s)
    kv_owner: dict[int, str] = {slot: "tree" for slot in cache.held_kv()}
    st_owner: dict[int, str] = {slot: "tree" for slot in cache.held_states()}
    for r in s.running.values():
        for slot in r.kv_slots[r.tree_len :]:
            assert slot not in kv_owner, f"kv slot {slot} owned by {r.rid} and {kv_owner[slot]}"
            kv_owner[slot] = r.rid
        if r.state_slot is not None:
            assert r.state_slot not in st_owner, f"state slot {r.state_slot}: {r.rid} and {st_owner[r.state_slot]}"
            st_owner[r.state_slot] = r.rid
        if r.backup_slot is not None:
            assert r.backup_slot not in st_owner, f"backup slot {r.backup_slot}: {r.rid} and {st_owner[r.backup_slot]}"
            st_owner[r.backup_slot] = r.rid
    for r in s.loading.values():
        assert r.load is not None
        for slot in r.load.kv_slots:
            assert slot not in kv_owner, f"kv slot {slot} loading for {r.rid} and owned by {kv_owner[slot]}"
            kv_owner[slot] = r.rid
        if (slot := r.load.state_slot) is not None:
            assert slot not in st_owner, f"state slot {slot} loading for {r.rid} and owned by {st_owner[slot]}"
            st_owner[slot] = r.rid
    _check_cover(res.kv_alloc, kv_owner, "kv slot")
    _check_cover(res.state_alloc, st_owner, "state slot")
    _check_locks(s)
    s.lora.check_integrity([*s.reqs.values(), *s.reusing.values()], s.running.values())


def _check_cover(alloc: Any, owner: dict[int, str], kind: str) -> None:
    for slot in range(1, alloc.capacity + 1):
        held = slot in owner
        assert held != alloc.is_free(slot), (
            f"{kind} {slot} is {'free and held by ' + owner[slot] if held else 'neither free nor held'}"
        )
    assert all(0 < slot <= alloc.capacity for slot in owner), f"{kind} id out of range"


def _check_requests(s: SchedulerState) -> None:
    assert len(s.waiting) + len(s.running) + len(s.loading) == len(s.reqs), (
        f"{len(s.waiting)} waiting + {len(s.running)} running + {len(s.loading)} loading != {len(s.reqs)} requests"
    )
    for rid, r in s.loading.items():
        assert r.status is ReqStatus.LOADING and s.reqs.get(rid) is r and r.load is not None, f"{r} loading"
        assert not r.kv_slots and r.node is None and r.state_slot is None, f"loading {r} holds a request's slots"
    for r in s.waiting.items():
        assert r.status is ReqStatus.WAITING and s.reqs.get(r.rid) is r, f"{r} queued but not waiting"
        assert not r.kv_slots and r.node is None and r.state_slot is None and r.cow_node is None, (
            f"waiting {r} still holds resources"
        )
        assert r.backup_slot is None, f"waiting {r} holds a backup state slot"
    for rid, r in s.running.items():
        assert r.status is ReqStatus.RUNNING and s.reqs.get(rid) is r, f"{r} in the running set"
        assert r.node is not None and r.tree_len == r.node.end, f"{r}: tree_len {r.tree_len} != node end"
        assert r.kv_slots[: r.tree_len] == s.res.cache.path_kv(r.node), f"{r}: prefix slots differ from the tree"
        entry = s.in_flight.by_rid.get(rid) if s.in_flight is not None else None
        drafts = len(entry.drafts) if entry is not None else 0
        assert r.computed <= len(r.kv_slots) <= len(r.tokens) + drafts, f"{r}: {len(r.kv_slots)} kv slots"
        assert (r.backup_slot is not None) == (drafts > 0 and s.track_states), f"{r}: backup {r.backup_slot}"
        assert (r.state_slot is not None) == s.track_states, f"{r}: state slot {r.state_slot}"
        if s.in_flight is None:
            assert len(r.kv_slots) == r.computed, f"{r}: slots beyond computed with nothing in flight"
            assert r.cow_node is None, f"{r}: copy-on-write lock held with nothing in flight"
    if s.in_flight is not None:
        for e in s.in_flight.entries:
            assert s.running.get(e.req.rid) is e.req, f"in-flight {e.req} is not running"


def _check_locks(s: SchedulerState) -> None:
    cache = s.res.cache
    holds = Counter(id(r.node) for r in s.running.values() if r.node is not cache.root)
    holds.update(id(r.load.node) for r in s.loading.values() if r.load is not None and r.load.node is not cache.root)
    state_holds = Counter(id(r.cow_node) for r in s.running.values() if r.cow_node is not None)
    for node in cache.nodes():
        direct = cache.direct_kv_holds(node)
        assert direct == holds.get(id(node), 0), f"{node}: {direct} direct KV locks, {holds.get(id(node), 0)} holders"
        assert node.state_lock == state_holds.get(id(node), 0), f"{node}: state lock without a pending copy"


def server_info(s: SchedulerState) -> SchedulerInfo:
    res, cache, m = s.res, s.res.cache, s.metrics
    kv_req = sum(len(r.kv_slots) - r.tree_len for r in s.running.values())
    st_req = sum(1 for r in s.running.values() if r.state_slot is not None)
    queried = m.get("hyssm_prefix_cache_queried_tokens_total")
    state_hit = m.get("hyssm_prefix_cache_hit_tokens_total", kind="state")
    kv_only = m.get("hyssm_prefix_cache_hit_tokens_total", kind="kv_only")
    server = ServerState(
        kv_capacity=res.kv_alloc.capacity,
        kv_free=res.kv_alloc.num_free,
        kv_cached=cache.kv_total,
        kv_evictable=cache.kv_evictable,
        kv_used_by_requests=kv_req,
        state_capacity=res.state_alloc.capacity,
        state_free=res.state_alloc.num_free,
        state_cached=cache.states_total,
        state_evictable=cache.states_evictable,
        state_used_by_requests=st_req,
        num_running=len(s.running),
        max_running_requests=s.max_running,
        num_waiting=len(s.waiting),
        num_cache_nodes=cache.num_nodes,
        num_locked_nodes=cache.num_locked_nodes,
        prefix_queried_tokens=queried,
        prefix_state_hit_tokens=state_hit,
        prefix_kv_only_tokens=kv_only,
        prefix_state_hit_rate=state_hit / queried if queried else 0.0,
        prefix_kv_match_rate=(state_hit + kv_only) / queried if queried else 0.0,
        checkpoints_saved=m.get("hyssm_checkpoints_total", result="saved"),
        checkpoints_skipped=m.get("hyssm_checkpoints_total", result="skipped"),
        retractions_kv=m.get("hyssm_retractions_total", cause="kv"),
        retractions_priority=m.get("hyssm_retractions_total", cause="priority"),
        batch_is_full=s.retry.batch_is_full,
        new_token_ratio=s.new_token_ratio,
        radix_cache=not s.args.disable_radix_cache,
        schedule_policy=s.args.schedule_policy,
        context_length=s.context_length,
        state_store=s.store_stats,
    )
    gauges = [
        ("hyssm_kv_slots", "KV token slots by state.", {"state": "free"}, res.kv_alloc.num_free),
        ("hyssm_kv_slots", "KV token slots by state.", {"state": "cached"}, cache.kv_total),
        ("hyssm_kv_slots", "KV token slots by state.", {"state": "requests"}, kv_req),
        ("hyssm_kv_slots_capacity", "KV token slots in all.", {}, res.kv_alloc.capacity),
        ("hyssm_kv_slots_evictable", "Cached KV token slots no running request locks (part of cached).", {},
         cache.kv_evictable),
        ("hyssm_mamba_slots", "state slots by state.", {"state": "free"}, res.state_alloc.num_free),
        ("hyssm_mamba_slots", "state slots by state.", {"state": "cached"}, cache.states_total),
        ("hyssm_mamba_slots", "state slots by state.", {"state": "requests"}, st_req),
        ("hyssm_mamba_slots_capacity", "state slots in all.", {}, res.state_alloc.capacity),
        ("hyssm_mamba_slots_evictable", "Cached state slots no running request locks (part of cached).", {},
         cache.states_evictable),
        ("hyssm_num_running_reqs", "Requests in the running batch.", {}, len(s.running)),
        ("hyssm_num_waiting_reqs", "Requests in the waiting queue.", {}, len(s.waiting)),
        ("hyssm_cache_locked_nodes", "Radix-cache nodes locked by running requests.", {}, cache.num_locked_nodes),
        ("hyssm_new_token_ratio", "Share of max_new_tokens reserved for running requests.", {}, s.new_token_ratio),
        ("hyssm_lora_adapters", "LoRA adapters registered (unloaded ones still finishing requests excluded).", {},
         len(s.lora.by_name)),
        ("hyssm_lora_slots_used", "Adapter slots holding an adapter (of --max-loras-per-batch).", {},
         s.lora.in_slots()),
    ]
    return SchedulerInfo(server=server, metrics=m.records(gauges) + store_records(s.store_stats))


def store_records(st: StoreStats | None) -> list[MetricRecord]:
    """The state store's counters and size (rank 0's, as of the last step) as metric records."""
    if st is None:
        return []
    def rec(name: str, kind: str, text: str, value: float, **labels: str) -> MetricRecord:
        return MetricRecord(name=name, type=kind, help=text, labels=labels, value=value)  # type: ignore[arg-type]
    by_op = "State store {} by operation (write: stored by the writer; read: loaded back)."
    return [
        rec("hyssm_state_store_bytes_total", "counter", by_op.format("payload bytes"), st.bytes_written, op="write"),
        rec("hyssm_state_store_bytes_total", "counter", by_op.format("payload bytes"), st.bytes_read, op="read"),
        rec("hyssm_state_store_entries_total", "counter", by_op.format("entries"), st.entries_written, op="write"),
        rec("hyssm_state_store_entries_total", "counter", by_op.format("entries"), st.entries_read, op="read"),
        rec("hyssm_state_store_errors_total", "counter", "State store writes the store refused and entries that "
            "could not be read back (missing, damaged, store unreachable).", st.write_errors, op="write"),
        rec("hyssm_state_store_errors_total", "counter", "", st.read_errors, op="read"),
        rec("hyssm_state_store_write_drops_total", "counter", "State store writes dropped because the writer's "
            "queue (--state-cache-write-queue-mb) was full.", st.write_drops),
        rec("hyssm_state_store_size_bytes", "gauge", "Bytes this server keeps in the state store.", st.size_bytes),
        rec("hyssm_state_store_capacity_bytes", "gauge", "--state-cache-size-gb in bytes.", st.capacity_bytes),
        rec("hyssm_state_store_degraded", "gauge", "1 while the state store fails writes (memory-only serving).",
            int(st.degraded)),
    ]
