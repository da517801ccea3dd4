"""Tensor-parallel test harness: run ranks in-process with
torch.multiprocessing (spawn) + gloo on a free loopback port, and a deterministic serving script
that drives a `ModelRunner` the way the scheduler would (staggered arrivals, chunked prefill,
decode, a copy-on-write fork), identically on every rank.

Every rank sees the same batches: in "logits" mode each rank picks the greedy token from its own
logits (they must be identical across ranks); in "step" mode rank 0 samples through
`ModelRunner.step` and broadcasts its tokens, as the scheduler would send them to every rank.
"""

from __future__ import annotations

import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from shared.messages import CopyOp, ForwardBatch, ReqSlice, SamplingParams
from tests.model_driver import forward_all_logits, forward_logits
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)
KV_SLOTS = 256
MAMBA_SLOTS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------- ranks
def _rank_main(rank: int, size: int, port: int, fn: Callable[..., Any], args: tuple, out: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=timedelta(seconds=60)
        )
        out.put((rank, True, fn(rank, size, dist.group.WORLD, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], size: int, args: tuple = (), timeout: float = 60.0) -> list[Any]:
    """Run `fn(rank, size, group, *args)` on `size` spawned ranks; return their results by rank.
    Results must pickle by value (numpy, not tensors). Kills every rank it started."""
    ctx = tmp.get_context("spawn")
    results: Any = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, fn, args, results), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead:  # died without a report (a report is put before the rank exits)
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(size)) - set(got))
                    raise TimeoutError(f"ranks {missing} gave no result in {timeout}s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = value
        return [got[r] for r in range(size)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


# ---------------------------------------------------------------------------------- script
@dataclass(frozen=True)
class ReqSpec:
    rid: str
    prompt: tuple[int, ...]
    chunk: int  # prefill chunk length
    arrive: int = 0  # first step it may run in
    fork_of: str = ""  # copy-on-write fork of this request's state right after its prompt


@dataclass
class _Live:
    spec: ReqSpec
    slot: int
    kv: list[int]
    started: bool = False
    pos: int = 0  # tokens in the KV cache / Mamba state
    prompt_fed: int = 0  # tokens of its own prompt fed so far
    out: list[int] = field(default_factory=list)


@dataclass
class Trace:
    tokens: dict[str, list[int]]
    logits: list[dict[str, np.ndarray]]  # per step: rid -> last-position logits [V] ("logits" mode)


def default_specs(vocab: int) -> list[ReqSpec]:
    rng = np.random.default_rng(5)

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(3, vocab, n))

    return [
        ReqSpec("a", prompt(19), chunk=7),
        ReqSpec("b", prompt(11), chunk=11, arrive=1),
        ReqSpec("c", prompt(4), chunk=3, fork_of="a"),
        ReqSpec("d", prompt(1), chunk=1, arrive=2),
    ]


def drive(runner: ModelRunner, specs: list[ReqSpec], n_new: int, mode: str, group: Any) -> Trace:
    """Serve `specs` to `n_new` tokens each. A fork request starts from its source's Mamba state
    at the end of the source's prompt (CopyOp before the source's first decode) and shares its
    KV prefix, then prefills its own prompt."""
    live: dict[str, _Live] = {}
    next_kv = 1
    by_rid = {s.rid: s for s in specs}
    for i, s in enumerate(specs):
        need = (len(by_rid[s.fork_of].prompt) if s.fork_of else 0) + len(s.prompt) + n_new
        live[s.rid] = _Live(s, slot=i + 1, kv=list(range(next_kv, next_kv + need)))
        next_kv += need
    logits: list[dict[str, np.ndarray]] = []
    step = 0
    while any(len(r.out) < n_new for r in live.values()):
        reqs, copies, clears = _plan_step(live, step, n_new)
        batch = ForwardBatch(step=step, reqs=reqs, copies=copies, clears=clears)
        tokens = _run_step(runner, batch, mode, group, logits)
        for rs in reqs:
            r = live[rs.rid]
            r.pos += len(rs.input_ids)
            if r.prompt_fed < len(r.spec.prompt):
                r.prompt_fed += len(rs.input_ids)
            if rs.sample:
                r.out.append(tokens[rs.rid])
        step += 1
        assert step < 200, "script does not finish"
    return Trace({rid: r.out for rid, r in live.items()}, logits)


def _plan_step(live: dict[str, _Live], step: int, n_new: int) -> tuple[list[ReqSlice], list[CopyOp], list[int]]:
    reqs: list[ReqSlice] = []
    copies: list[CopyOp] = []
    clears: list[int] = []
    for r in live.values():
        s = r.spec
        if step < s.arrive or len(r.out) >= n_new:
            continue
        if not r.started and s.fork_of:
            src = live[s.fork_of]
            if src.prompt_fed < len(src.spec.prompt) or len(src.out) != 1:
                continue  # the source's state is exactly at the end of its prompt only now
            copies.append(CopyOp(src=src.slot, dst=r.slot, rid=s.rid))
            r.kv[: src.pos] = src.kv[: src.pos]
            r.pos = src.pos
        elif not r.started:
            clears.append(r.slot)
        r.started = True
        left = s.prompt[r.prompt_fed :]
        ids = list(left[: s.chunk]) if left else [r.out[-1]]
        sample = not left or len(ids) == len(left)
        reqs.append(ReqSlice(rid=s.rid, input_ids=ids, start_pos=r.pos, kv_slots=r.kv[: r.pos + len(ids)],
                             state_slot=r.slot, sample=sample, sampling=GREEDY, output_len=len(r.out)))
    return reqs, copies, clears


def _run_step(
    runner: ModelRunner, batch: ForwardBatch, mode: str, group: Any, logits: list[dict[str, np.ndarray]]
) -> dict[str, int]:
    if mode == "logits":
        out = forward_logits(runner, batch)
        logits.append({rid: v.numpy().copy() for rid, v in out.items()})
        return {rid: int(v.argmax()) for rid, v in out.items()}
    result = runner.step(batch)
    assert result.error is None, result.error
    box = [result.next_tokens]
    if group is not None:
        dist.broadcast_object_list(box, src=0, group=group)  # the scheduler's role: same inputs to every rank
    return box[0]


# ---------------------------------------------------------------------------------- per rank
def model_traces(
    rank: int, size: int, group: Any, model_dir: str, n_new: int, prompt: list[int] | None
) -> dict[str, Any]:
    """Everything the parity tests compare, computed by one rank of a `size`-rank group (or alone
    when `group` is None): both script modes and, when `prompt` is given, all-position logits."""
    def make() -> ModelRunner:
        return ModelRunner(model_dir,
            WorkerConfig(dtype="float32", kv_slots=KV_SLOTS, state_slots=MAMBA_SLOTS,
                                       tp_rank=rank, tp_size=size, deterministic=True), tp_group=group)

    runner = make()
    specs = default_specs(runner.cfg.vocab_size)
    result: dict[str, Any] = {"logits": drive(runner, specs, n_new, "logits", group)}
    runner.check_integrity()
    runner = make()
    result["step"] = drive(runner, specs, n_new, "step", group)
    if prompt is not None:
        n = len(prompt)
        req = ReqSlice(
            rid="p",
            input_ids=prompt,
            start_pos=0,
            kv_slots=list(range(1, n + 1)),
            state_slot=1,
            sample=True,
            sampling=GREEDY,
        )
        result["prompt_logits"] = forward_all_logits(runner, ForwardBatch(step=0, reqs=[req], clears=[1]))["p"].numpy()
    result["capacity"] = (runner.kv_capacity, runner.state_capacity, runner.pools.nbytes())
    return result


def models_traces(rank: int, size: int, group: Any, jobs: list[tuple[str, str, int, list[int] | None]]) -> dict:
    """`model_traces` for several (name, model_dir, n_new, prompt) jobs in one group."""
    return {name: model_traces(rank, size, group, path, n, prompt) for name, path, n, prompt in jobs}
