"""The worker process of one tensor-parallel rank: receive ForwardBatch, agree on refusals with
every other rank, run the step on the model runtime, rank 0 replies with a StepResult.

Owns: the model weights and the KV / Mamba state pools (inside `ModelRunner`), the
torch.distributed process group of the ranks, and the fault-injection decisions of this rank.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from shared.channels import SCHEDULER_TO_WORKER, TO_LAUNCHER, WORKER_TO_SCHEDULER, ChannelTimeout, Receiver, Sender
from shared.config import FaultConfig, ServerArgs
from shared.errors import StartupError
from shared.messages import ForwardBatch, Heartbeat, ProcReady, Shutdown, StepResult, WorkerReady
from shared.proc import STOP_SIGNAL
from shared.state_store import StoreError
from worker_proc.host.setup import apply_host_settings
from worker_proc.plan.source import default_cache_dir
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner
from worker_proc.startup_beacon import StartupBeacon
from worker_proc.state.store_loader import FAILED, READ, READING
from worker_proc.state.store_tier import StoreTier, namespace_json, store_namespace

logger = logging.getLogger(__name__)

STEP_SPIN_S = 0.002
"""How long a rank polls for its next batch without blocking before it sleeps in a blocking poll. The
scheduler's next batch usually follows a result within a millisecond; a rank that slept meanwhile ran
its next step cold. Measured on a 2-core VM, built-in model served at concurrency 1: 4.5-4.9 -> 3.1-3.2
ms per decode token, 179-203 -> 231-259 tok/s. Idle, the spin costs 2 ms per second of waiting."""


def resolve_device(args: ServerArgs, rank: int) -> str:
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    local = rank % args.ranks_per_node
    return f"cuda:{args.base_gpu_id + local}"


def plan_cache_dir(args: ServerArgs) -> Path | None:
    if args.execution_plan_cache == "none":
        return None
    return Path(args.execution_plan_cache) if args.execution_plan_cache else default_cache_dir()


def init_distributed(args: ServerArgs, rank: int, device: str) -> object | None:
    if args.tp_size == 1:
        return None
    backend = "nccl" if device.startswith("cuda") else "gloo"
    host, _, port = args.dist_init_addr.rpartition(":")
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=args.tp_size,
            timeout=timedelta(seconds=args.startup_timeout),
        )
    except Exception as e:  # noqa: BLE001 - re-raised with the address named
        raise StartupError(f"rank {rank}: cannot join the process group at {args.dist_init_addr}: {e}") from e
    # The step collectives wait at most the watchdog timeout (a step may not take longer): a rank
    # whose peer is gone (a node lost, a partitioned link) fails its step instead of hanging
    # there for the start-up timeout, then exits on the scheduler's silence.
    return dist.new_group(list(range(args.tp_size)), timeout=timedelta(seconds=args.watchdog_timeout))


class FaultInjector:
    """This rank's fault decisions; deterministic in (seed, rank, step)."""

    def __init__(self, faults: FaultConfig, rank: int, name: str = "") -> None:
        self.faults = faults
        self.rank = rank
        self.name = name or f"worker-tp{rank}"

    def refusals(self, batch: ForwardBatch) -> set[str]:
        frac = self.faults.refuse_cow_fraction
        if frac <= 0:
            return set()
        rng = random.Random(hash((self.faults.seed, self.rank, batch.step)))
        return {op.rid for op in batch.copies if op.rid is not None and rng.random() < frac}

    def before_step(self, step: int) -> None:
        f = self.faults
        if f.crash_process == self.name and step == f.crash_at_step:
            logger.error("fault injection: %s crashing at step %d", self.name, step)
            os._exit(17)
        if f.delay_step_s > 0:
            time.sleep(f.delay_step_s)  # simulated slow device, not synchronisation
        if step == f.raise_at_step:
            raise RuntimeError(f"fault injection: error in step {step}")


def agree_refusals(
    batch: ForwardBatch, local: set[str], group: object | None, device: torch.device | str = "cpu"
) -> frozenset[str]:
    """A request is refused on every rank if any rank refused it (all-reduce MAX of a mask).
    `device`: the rank's model device (NCCL reduces only CUDA tensors, gloo CPU ones)."""
    if group is None:
        return frozenset(local)
    rids = [op.rid for op in batch.copies if op.rid is not None]
    if not rids:
        return frozenset()
    mask = torch.tensor([1 if rid in local else 0 for rid in rids], dtype=torch.int32, device=device)
    dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
    return frozenset(rid for rid, m in zip(rids, mask.tolist(), strict=True) if m)


def agree_load_states(states: list[int], group: object | None, device: torch.device | str = "cpu") -> list[int]:
    """Per pending store load, what every rank agrees on: read only when every rank read it, failed
    when a rank failed it and every rank is done with it (all-reduce MAX of (still reading, failed))."""
    if group is None or not states:
        return states
    pairs = [(int(s == READING), int(s == FAILED)) for s in states]
    mask = torch.tensor(pairs, dtype=torch.int32, device=device)
    dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
    return [READING if reading else FAILED if failed else READ for reading, failed in mask.tolist()]


LOAD_WAIT_S = 0.05
"""A batch with no request to run (the scheduler polls its loads) waits this long at most for a load."""


def serve_store(tier: StoreTier | None, batch: ForwardBatch, group: object | None,
                device: torch.device | str) -> tuple[list[int], list[int]]:
    """The batch's store work before its step: writes and new loads, then the pending loads every
    rank has read are applied. Returns the ids of the loads (done, failed) this step settled."""
    if tier is None:
        return [], []
    tier.serve(batch)
    states = tier.loader.states(wait_s=0.0 if batch.reqs else LOAD_WAIT_S)
    return tier.loader.settle(agree_load_states(states, group, device))


def open_store(args: ServerArgs, runner: ModelRunner, rank: int) -> tuple[StoreTier | None, str]:
    """This rank's state store (--state-cache-dir) and its namespace's canonical JSON; (None, "") without one."""
    if not args.state_store_enabled:
        return None, ""
    numerics = runner.plan.kernels.ops + ("+deterministic" if args.enable_deterministic_inference else "")
    namespace = store_namespace(args, runner.dtype, numerics, rank)
    try:
        tier = StoreTier.open(args, namespace, runner.pools)
    except StoreError as e:
        where = args.state_cache_dir or args.hicache_storage_backend_extra_config
        raise StartupError(f"rank {rank}: state store ({args.hicache_storage_backend}, {where}): {e}") from e
    return tier, namespace_json(namespace)


class WorkerStop(BaseException):
    """STOP_SIGNAL from launch.py: leave the step loop; queued state store writes are finished first."""


def _raise_stop(signum: int, _frame: object) -> None:
    raise WorkerStop(signal.Signals(signum).name)


def run(args: ServerArgs, rank: int, ctx: zmq.Context, beacon: StartupBeacon) -> None:
    """One rank (worker_proc/entry.py started `beacon` on `ctx`): load, stop the beacon, report ready,
    serve batches until Shutdown or killed."""
    try:
        device = resolve_device(args, rank)
        host = apply_host_settings(args, rank, device)
        beacon.phase = "joining the process group"
        group = init_distributed(args, rank, device)
        config = WorkerConfig.from_server_args(args, device=device, rank=rank, thread_options=host.thread_options,
                                              plan_cache_dir=plan_cache_dir(args))
        beacon.phase = "loading the model (kernels, weights, execution plan)"
        if args.faults.delay_start_s > 0:
            time.sleep(args.faults.delay_start_s)  # a simulated slow start, not synchronisation
        runner = ModelRunner(args.resolved_model_path, config, tp_group=group)
        beacon.phase = "opening the state store"
        tier, namespace = open_store(args, runner, rank)
    finally:
        beacon.stop()
    rx: Receiver = Receiver(ctx, SCHEDULER_TO_WORKER, args, rank)
    tx: Sender = Sender(ctx, WORKER_TO_SCHEDULER, args)
    ready = WorkerReady(
        rank=rank,
        kv_slots=runner.kv_capacity,
        state_slots=runner.state_capacity,
        device=device,
        dtype=str(args.dtype),
        store_namespace=namespace,
    )
    tx.send(ready, int(args.startup_timeout * 1000))
    to_launcher: Sender = Sender(ctx, TO_LAUNCHER, args)
    to_launcher.send(ProcReady(name=args.proc_name("worker", rank), info={f"rank{rank}_device": device}))
    to_launcher.close(linger_ms=2000)
    logger.info("rank %d ready on %s: kv=%d mamba=%d", rank, device, runner.kv_capacity, runner.state_capacity)
    faults = FaultInjector(args.faults, rank, args.proc_name("worker", rank))
    if tier is not None:  # a stop lets the queued writes finish
        signal.signal(STOP_SIGNAL, _raise_stop)
    try:
        serve(runner, rx, tx if rank == 0 else None, faults, group, args, tier)
    except WorkerStop:
        logger.info("rank %d stopping", rank)
    finally:
        if tier is not None:
            signal.signal(STOP_SIGNAL, signal.SIG_IGN)  # launch.py waits for the queued writes
            tier.close(args.graceful_shutdown_timeout)


def serve(
    runner: ModelRunner,
    rx: Receiver,
    tx: Sender | None,
    faults: FaultInjector,
    group: object | None,
    args: ServerArgs,
    tier: StoreTier | None = None,
) -> None:
    """The step loop. `tx` is None on ranks other than 0 (only rank 0 replies). The scheduler
    sends something at least every second; silence past the watchdog timeout (the start-up
    timeout before the first message) means node 0 is gone, and this rank exits."""
    silence_limit = args.startup_timeout
    last_heard = time.monotonic()
    while True:
        try:
            msg = rx.recv_spinning(STEP_SPIN_S, 1000)
        except ChannelTimeout:
            if time.monotonic() - last_heard > silence_limit:
                raise TimeoutError(f"no message from the scheduler for {silence_limit:.0f}s") from None
            continue
        last_heard = time.monotonic()
        silence_limit = args.watchdog_timeout + 2.0
        if isinstance(msg, Shutdown):
            logger.info("shutdown: %s", msg.reason)
            return
        if isinstance(msg, Heartbeat):
            continue
        t0 = time.perf_counter()
        try:
            faults.before_step(msg.step)
            refused = agree_refusals(msg, faults.refusals(msg), group, runner.device)
            done, failed = serve_store(tier, msg, group, runner.device)
            result = runner.step(msg, refused)
            result.store_done, result.store_failed = done, failed
        except Exception as e:  # the step failed: its requests get an error, serving goes on
            logger.exception("step %d failed", msg.step)
            result = StepResult(step=msg.step, error=f"{type(e).__name__}: {e}")
            if tier is not None:
                tier.loader.drop()
        if tier is not None and tx is not None:
            result.store = tier.take_stats()
        result.elapsed_s = time.perf_counter() - t0
        if tx is not None:
            tx.send(result)
