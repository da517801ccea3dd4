"""--dp-size pieces without processes: the flag, replica names and endpoints, the launch's process
list and failure rule (shared/replicas.py), and ReplicatedBackend behind the HTTP app with fake
replicas (routing, a replica going down mid-request, /health, /get_server_info, /metrics)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import httpx
import pytest

import hyssm.serve as launch
from shared.channels import SCHEDULER_TO_TOKENIZER, SCHEDULER_TO_WORKER, TO_LAUNCHER, TOKENIZER_TO_SCHEDULER
from shared.config import ConfigError, ServerArgs
from shared.messages import LoraAdapter, MetricRecord, SchedulerInfo, ServerState, StoreStats
from shared.replicas import ReplicaSet, dist_addrs, node_processes
from tests.tokenizer.conftest import FakeBackend
from tokenizer_proc import create_app
from tokenizer_proc.replicas.backend import ReplicatedBackend, merge_metrics, merge_states


def test_dp_size_flag_is_validated(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.parse_args(["--dp-size", "3"]).dp_size == 3
    assert launch.main(["--dp-size", "0"]) == 2
    assert capsys.readouterr().err == "hyssm-launch: error: --dp-size must be a positive integer, got 0\n"
    with pytest.raises(ConfigError, match="--dp-size > 1 runs on one node"):
        ServerArgs(dp_size=2, nnodes=2, tp_size=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ConfigError, match="dp_rank"):
        ServerArgs(dp_size=2, dp_rank=2)
    with pytest.raises(SystemExit):  # dp_rank is the launcher's to set, not a flag
        launch.parse_args(["--dp-rank", "1"])


def test_names_and_endpoints_per_replica() -> None:
    one = ServerArgs(run_dir="/r")
    assert [one.proc_name("scheduler"), one.proc_name("worker", 1)] == ["scheduler", "worker-tp1"]
    assert SCHEDULER_TO_WORKER.endpoint(one, 1) == "ipc:///r/sched_to_worker-1"  # unchanged without replicas
    a, b = ServerArgs(run_dir="/r", dp_size=2), ServerArgs(run_dir="/r", dp_size=2, dp_rank=1)
    assert [b.proc_name("scheduler"), b.proc_name("worker", 0), b.proc_name("tokenizer")] == [
        "scheduler-dp1", "worker-dp1-tp0", "tokenizer"]
    for ch in (TOKENIZER_TO_SCHEDULER, SCHEDULER_TO_TOKENIZER):
        assert ch.endpoint(a) != ch.endpoint(b)
    assert SCHEDULER_TO_WORKER.endpoint(b, 0) == "ipc:///r/sched_to_worker-dp1-0"
    assert TO_LAUNCHER.endpoint(a) == TO_LAUNCHER.endpoint(b) == "ipc:///r/to_launcher"


def test_node_processes_give_each_replica_its_own_args() -> None:
    args = ServerArgs(dp_size=2, tp_size=2, base_gpu_id=1, run_dir="/r")
    addrs = dist_addrs(args, iter([41001, 41002]).__next__)
    assert addrs == ["127.0.0.1:41001", "127.0.0.1:41002"]
    specs = node_processes(args, addrs)
    assert [s.name for s in specs] == ["worker-dp0-tp0", "worker-dp0-tp1", "scheduler-dp0", "worker-dp1-tp0",
                                       "worker-dp1-tp1", "scheduler-dp1", "tokenizer"]  # fmt: skip
    by = {s.name: s for s in specs}
    assert by["worker-dp1-tp1"].args.dp_rank == 1 and by["worker-dp1-tp1"].rank == 1
    assert by["worker-dp1-tp0"].args.base_gpu_id == 3 and by["worker-dp0-tp0"].args.base_gpu_id == 1
    assert by["scheduler-dp1"].args.dist_init_addr == "127.0.0.1:41002"
    assert by["tokenizer"].args == args and by["tokenizer"].replica is None
    given = ServerArgs(dp_size=3, tp_size=2, dist_init_addr="10.0.0.1:5000")
    assert dist_addrs(given, lambda: 0) == ["10.0.0.1:5000", "10.0.0.1:5001", "10.0.0.1:5002"]
    assert dist_addrs(ServerArgs(dp_size=2), lambda: 0) == ["", ""]
    single = node_processes(ServerArgs(run_dir="/r"), [""])
    assert [s.name for s in single] == ["worker-tp0", "scheduler", "tokenizer"]


def test_replica_set_takes_down_one_replica_until_the_last() -> None:
    args = ServerArgs(dp_size=3, run_dir="/r")
    rs = ReplicaSet(node_processes(args, [""] * 3))
    assert rs.ends_launch("tokenizer")
    assert not rs.ends_launch("worker-dp1-tp0")
    assert rs.take_down("worker-dp1-tp0", "gone") == (1, ["scheduler-dp1"])
    assert rs.args_of(1).dp_rank == 1
    assert rs.up == [0, 2] and not rs.ends_launch("scheduler-dp0")
    rs.take_down("scheduler-dp0", "gone")
    assert rs.ends_launch("worker-dp2-tp0")  # the last replica up
    rs.check_integrity()
    alone = ReplicaSet(node_processes(ServerArgs(run_dir="/r"), [""]))
    assert alone.ends_launch("worker-tp0") and alone.ends_launch("scheduler")


def _rec(name: str, mtype: str, value: float, **labels: str) -> MetricRecord:
    return MetricRecord(name=name, type=mtype, help=name, labels=labels, value=value)  # type: ignore[arg-type]


def test_merge_sums_counts_and_recomputes_rates() -> None:
    a = ServerState(kv_capacity=100, num_running=2, prefix_queried_tokens=100, prefix_state_hit_tokens=50,
                    prefix_state_hit_rate=0.5, new_token_ratio=0.2, context_length=4096, schedule_policy="fcfs")
    b = ServerState(kv_capacity=100, num_running=1, prefix_queried_tokens=300, prefix_state_hit_tokens=0,
                    batch_is_full=True, new_token_ratio=0.4, context_length=4096, schedule_policy="fcfs")
    m = merge_states([a, b])
    assert (m.kv_capacity, m.num_running, m.prefix_state_hit_tokens) == (200, 3, 50)
    assert m.prefix_state_hit_rate == pytest.approx(50 / 400) and m.new_token_ratio == pytest.approx(0.3)
    assert m.batch_is_full and m.context_length == 4096 and m.schedule_policy == "fcfs"
    live = [[_rec("hyssm_x_total", "counter", 3, kind="state"), _rec("hyssm_num_running_reqs", "gauge", 2)],
            [_rec("hyssm_x_total", "counter", 4, kind="state"), _rec("hyssm_num_running_reqs", "gauge", 1)]]
    gone = [[_rec("hyssm_x_total", "counter", 10, kind="state"), _rec("hyssm_num_running_reqs", "gauge", 7)]]
    merged = {(r.name, tuple(r.labels.items())): r.value for r in merge_metrics(live, gone)}
    assert merged == {("hyssm_x_total", (("kind", "state"),)): 17, ("hyssm_num_running_reqs", ()): 3}


def test_merge_adds_up_the_state_stores() -> None:
    a = ServerState(state_store=StoreStats(entries_written=3, bytes_read=10, size_bytes=5, load_seconds=[0.1]))
    b = ServerState(state_store=StoreStats(entries_written=4, degraded=True, load_seconds=[0.2]))
    merged = merge_states([a, b, ServerState()]).state_store
    assert merged is not None and (merged.entries_written, merged.bytes_read, merged.size_bytes) == (7, 10, 5)
    assert merged.degraded and merged.load_seconds == [0.1, 0.2]
    assert merge_states([ServerState(), ServerState()]).state_store is None


@dataclass
class Replica(FakeBackend):
    """A FakeBackend with the rest of SchedulerClient's surface used by ReplicatedBackend."""

    dead_reason: str | None = None

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def abort_all(self, reason: str) -> int:
        return 0

    def go_down(self, reason: str) -> None:
        self.healthy, self.dead_reason, self.fail_with = False, reason, f"server error: {reason}"


def _replica(hits: int) -> Replica:
    info = SchedulerInfo(server=ServerState(prefix_state_hit_tokens=hits, kv_capacity=4096),  # every prompt fits
                         metrics=[_rec("hyssm_prefix_cache_hit_tokens_total", "counter", hits, kind="state")])
    return Replica(info_doc=info)


def test_backend_routes_fails_one_replica_and_reports_degraded(args, tok) -> None:
    gate = asyncio.Event()
    replicas = [_replica(5), _replica(7)]
    for r in replicas:
        r.gate = gate
    backend = ReplicatedBackend(replicas)  # type: ignore[list-item]
    app = create_app(args.replace(dp_size=2), backend, tok)  # type: ignore[arg-type]
    prefix = list(range(1, 49))

    async def gen(c: httpx.AsyncClient, ids: list[int]) -> httpx.Response:
        return await c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4}})

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            first = asyncio.create_task(gen(c, prefix + [60]))  # replica 0 (both idle)
            other = asyncio.create_task(gen(c, [70] * 40))  # no match: the idle replica 1
            while sum(len(r.submitted) for r in replicas) < 2:
                await asyncio.sleep(0)
            assert backend.loads == [1, 1]
            replicas[1].go_down("worker-dp1-tp0 exited unexpectedly (code -9)")
            gate.set()
            ok, failed = await first, await other
            assert ok.status_code == 200 and failed.status_code == 503, (ok.text, failed.text)
            assert "worker-dp1-tp0 exited" in failed.json()["error"]["message"]
            later = await gen(c, [70] * 40)  # would have followed its prefix to replica 1: goes to 0
            assert later.status_code == 200
            assert [len(r.submitted) for r in replicas] == [2, 1] and backend.loads == [0, 0]
            health = await c.get("/health")
            assert health.status_code == 200
            assert health.json() == {"status": "ok", "degraded": True, "replicas_up": 1, "dp_size": 2}
            info = (await c.get("/get_server_info")).json()
            assert [(r["dp_rank"], r["up"]) for r in info["replicas"]] == [(0, True), (1, False)]
            assert "exited unexpectedly" in info["replicas"][1]["error"]
            assert info["replicas"][0]["routed_requests"]["load"] >= 2
            metrics = (await c.get("/metrics")).text
            assert 'hyssm_dp_replica_up{dp_rank="1"} 0.0' in metrics
            load = (await c.get("/get_load")).json()  # sglang-router's view: the live replicas only
            assert [entry["dp_rank"] for entry in load] == [0]
            # replica 1 answered no info request before going down: only replica 0's counter counts
            hit = re.search(r'hyssm_prefix_cache_hit_tokens_total\{kind="state"\} (\S+)', metrics)
            assert hit and float(hit.group(1)) == 5.0
            replicas[0].go_down("worker-dp0-tp0 exited unexpectedly (code -9)")
            assert (await c.get("/health")).status_code == 503
            assert (await gen(c, [1, 2, 3])).status_code == 503

    asyncio.run(main())
    backend.check_integrity()


def test_get_load_lists_each_live_replica(args, tok) -> None:
    replicas = [_replica(0), _replica(0)]
    replicas[1].info_doc = SchedulerInfo(server=ServerState(num_running=2, num_waiting=1, kv_used_by_requests=30))
    backend = ReplicatedBackend(replicas)  # type: ignore[list-item]
    app = create_app(args.replace(dp_size=2), backend, tok)  # type: ignore[arg-type]

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            load = (await c.get("/get_load")).json()
            assert [(e["dp_rank"], e["num_reqs"], e["num_waiting_reqs"], e["num_tokens"]) for e in load] == [
                (0, 0, 0, 0), (1, 3, 1, 30)]

    asyncio.run(main())


def test_info_keeps_counters_of_a_replica_gone() -> None:
    replicas = [_replica(5), _replica(7)]
    backend = ReplicatedBackend(replicas)  # type: ignore[list-item]

    async def main() -> None:
        backend.router.choose(list(range(64)), [0, 1], [0, 0])
        assert len(backend.router.indexes[0]) == 4
        assert (await backend.info()).server.prefix_state_hit_tokens == 12
        replicas[1].go_down("gone")
        info = await backend.info()
        assert info.server.prefix_state_hit_tokens == 5 and info.server.kv_capacity == 4096  # live state only
        hits = [r.value for r in info.metrics if r.name == "hyssm_prefix_cache_hit_tokens_total"]
        assert hits == [12]  # the counter never goes back
        assert await backend.flush_cache() == (True, "")
        assert len(backend.router.indexes[0]) == 0  # a flushed replica holds no prefix any more
        replicas[0].flush_result = (False, "cannot flush the cache while requests are running")
        assert await backend.flush_cache() == (False, "replica 0: cannot flush the cache while requests are running")

    asyncio.run(main())


def test_lora_load_goes_to_every_replica_and_a_refused_one_is_undone() -> None:
    replicas = [_replica(0), _replica(0), _replica(0)]
    backend = ReplicatedBackend(replicas)  # type: ignore[list-item]
    adapter = LoraAdapter(name="sql", path="/a/sql", uid="u", rank=8, scaling=2.0, targets=("q_proj",))

    async def main() -> None:
        assert await backend.load_lora(adapter) == (True, "")
        assert await backend.unload_lora("sql") == (True, "")
        assert all(r.lora_calls == [("load", "sql"), ("unload", "sql")] for r in replicas)
        replicas[1].lora_result = (False, "no")
        replicas[2].go_down("gone")
        ok, message = await backend.load_lora(adapter)
        assert not ok and message == "no"
        assert replicas[0].lora_calls[2:] == [("load", "sql"), ("unload", "sql")]  # undone where it was taken
        assert replicas[2].lora_calls == [("load", "sql"), ("unload", "sql")]  # a replica down is not asked

    asyncio.run(main())
