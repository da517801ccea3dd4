"""The scheduler's state as it reports it: its part of /get_server_info (`SchedulerInfo`, answered
to GetInfoReq in an InfoResp) and of /metrics (`MetricRecord`s), and rank 0's state store counters
(`StoreStats`, sent with StepResults when the server has a store, and shown in ServerState). The
scheduler fills them (scheduler_proc/introspect.py, metrics.py); the tokenizer process formats them
and, over replicas, sums them (tokenizer_proc/replicas/backend.py)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MetricName = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")]


class MetricRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One Prometheus sample for GET /metrics. Several records may share a name (a family) with
    different labels; a counter's name ends in `_total`. A histogram is one record per bucket (label
    `le`: the bucket's upper bound, "+Inf" last; value: the cumulative count) and one with label
    `le` = "sum" (the sum of the observations); like counters, they add up across replicas."""

    name: MetricName
    type: Literal["counter", "gauge", "histogram"]
    help: str
    labels: dict[str, str]
    value: int | float


class StoreStats(msgspec.Struct, kw_only=True):
    """Rank 0's state store counters since start (cumulative) and its size now."""

    entries_written: int = 0
    bytes_written: int = 0
    entries_read: int = 0
    bytes_read: int = 0
    write_drops: int = 0  # writes dropped: the writer's queue was full
    queued_bytes: int = 0  # bytes waiting in the writer's queue now (the scheduler polls while there are)
    write_errors: int = 0  # writes the store refused (unreachable, disk full)
    read_errors: int = 0  # entries that could not be read back (missing, damaged, store unreachable)
    write_seconds: list[float] = []  # each write's time (queue wait excluded) since the previous StepResult
    load_seconds: list[float] = []  # each load's time since the previous StepResult
    size_bytes: int = 0
    capacity_bytes: int = 0
    degraded: bool = False  # the store failed its last write: the server runs on memory alone until one works


class ServerState(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler's pools, queues, prefix-cache hits and policy state (slot counts are token
    slots for KV and state slots for Mamba; `*_evictable` is part of `*_cached`)."""

    kv_capacity: int = 0
    kv_free: int = 0
    kv_cached: int = 0
    kv_evictable: int = 0
    kv_used_by_requests: int = 0
    state_capacity: int = 0
    state_free: int = 0
    state_cached: int = 0
    state_evictable: int = 0
    state_used_by_requests: int = 0
    num_running: int = 0
    max_running_requests: int = 0
    num_waiting: int = 0
    num_cache_nodes: int = 0
    num_locked_nodes: int = 0
    prefix_queried_tokens: int = 0
    prefix_state_hit_tokens: int = 0
    prefix_kv_only_tokens: int = 0
    prefix_state_hit_rate: float = 0.0
    prefix_kv_match_rate: float = 0.0
    checkpoints_saved: int = 0
    checkpoints_skipped: int = 0
    retractions_kv: int = 0
    retractions_priority: int = 0
    batch_is_full: bool = False
    new_token_ratio: float = 0.0
    radix_cache: bool = True
    schedule_policy: str = ""
    context_length: int = 0
    state_store: StoreStats | None = None  # rank 0's state store (--state-cache-dir), None without one


class LoopInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where the scheduler loop's wall time goes per served step (means in ms): the workers' own
    step time, the round trip (batch sent -> StepResult received) and their difference, and the
    turnaround (StepResult received -> next batch sent)."""

    steps: int = 0
    worker_ms_mean: float = 0.0
    round_trip_ms_mean: float = 0.0
    outside_worker_ms_mean: float = 0.0
    turnaround_ms_mean: float = 0.0


class SchedulerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler's part of /get_server_info (as JSON, under "scheduler") and of /metrics
    (`metrics`). `in_flight_step`: the step of the batch the workers are running, -1 for none."""

    server: ServerState
    metrics: list[MetricRecord] = []
    in_flight_step: int = -1
    loop: LoopInfo = LoopInfo()
