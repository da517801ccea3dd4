"""Micro-benchmark of the scheduler's admission path: the cost of one scheduling round while capacity
stays exhausted, with 1k / 10k requests queued behind a long shared prefix, and of the round that
admits when capacity comes back. Pure CPU, no model: a stub worker answers every step.

Two ways capacity runs out, each refusing the head of the queue every round (a hybrid model with a
state cache clears the full-batch latch every round, so admission is really tried each time):
- `state`: two recurrent-state slots, one held by a running decode request, one by the cached state of
  the shared prefix; every queued prompt hits that state, and a hit needs two slots (its own copy and
  the source it locks): refusal reason `mamba_state`;
- `kv`: the running requests hold or have reserved (every future token) nearly every KV token; the
  head's prompt does not fit; reason `kv`.
The round cost is schedule() + apply_result(); the same round with an empty queue is the baseline,
the difference is what the queue costs. Then capacity comes back (one running request ends) and the
next round admits the head; that round's cost is `admit µs`.

    python benchmarks/bench_scheduler.py [--queued 1000 10000] [--prefix 256 2048] [--rounds 3000]
        [--limits state kv] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler_proc.scheduler import Scheduler, SchedulerTuning  # noqa: E402
from shared.config import ServerArgs  # noqa: E402
from shared.messages import ForwardBatch, GenerateReq, SamplingParams, StepResult  # noqa: E402
from shared.model_info import ModelInfo  # noqa: E402

MODEL = ModelInfo("GraniteMoeHybridForCausalLM", ("mamba", "attention"), 1000, (), 1 << 20)
SAMPLING = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.0)
REASONS = {"state": "mamba_state", "kv": "kv"}
"""The refusal reason each exhausted resource produces."""


def stub_step(batch: ForwardBatch) -> StepResult:
    return StepResult(step=batch.step, next_tokens={s.rid: 7 for s in batch.reqs if s.sample})


def drive(sched: Scheduler, rounds: int) -> None:
    for _ in range(rounds):
        batch = sched.schedule()
        if batch is not None:
            sched.apply_result(stub_step(batch))


def build(limit: str, queued: int, prefix_len: int, runner_new: int) -> Scheduler:
    """Running requests that exhaust `limit` (see the module doc), then `queued` requests."""
    prompt = [5, 6, 7]
    prefix = [(i * 7919) % 997 + 1 for i in range(prefix_len)]
    runner = SamplingParams(max_new_tokens=runner_new, ignore_eos=True)
    if limit == "state":
        # two state slots: the shared prefix's cached state (a donor ran it; no prompt checkpoints, so
        # the runner's own prompt does not evict it) and the running request's
        args = ServerArgs(chunked_prefill_size=4096, max_prefill_tokens=8192, max_running_requests=2,
                          disable_prompt_checkpoint=True)  # fmt: skip
        sched = Scheduler(args, MODEL, kv_capacity=prefix_len + 8 * runner_new + 4096, state_capacity=2)
        sched.add_request(GenerateReq(rid="donor", input_ids=prefix + [1], sampling=SamplingParams(max_new_tokens=1)))
        drive(sched, 4)
        assert sched.cache.states_total == 1 and not sched.has_work, "the prefix state is not cached"
        runners = 1
    else:  # states to spare; KV for the running requests (prompts as long as the queued ones) and half a prompt
        runners = 2
        prompt = [500 + j % 400 for j in range(prefix_len)]
        args = ServerArgs(chunked_prefill_size=4096, max_prefill_tokens=8192, max_running_requests=runners + 8)
        kv = runners * (len(prompt) + runner_new) + prefix_len // 2
        # every future token of a running request reserved (ratio 1, no decay): the KV really is spoken for
        exact = SchedulerTuning(init_ratio=1.0, min_ratio=1.0, decay=0.0)
        sched = Scheduler(args, MODEL, kv_capacity=kv, state_capacity=2 * (runners + 8), tuning=exact)
    for i in range(runners):  # no two share a first token: nothing of one is a cache hit for another
        sched.add_request(GenerateReq(rid=f"runner{i}", input_ids=[900 + i, *prompt[1:]], sampling=runner))
    drive(sched, 2)
    assert len(sched.running) == runners
    for i in range(queued):
        sched.add_request(GenerateReq(rid=f"q{i}", input_ids=prefix + [1, 2 + i % 900], sampling=SAMPLING))
    return sched


def time_rounds(sched: Scheduler, rounds: int) -> float:
    """Mean µs per round (schedule + apply) over `rounds` rounds, best of 3 blocks."""
    blocks = []
    per = max(1, rounds // 3)
    for _ in range(3):
        t0 = time.perf_counter()
        drive(sched, per)
        blocks.append((time.perf_counter() - t0) / per * 1e6)
    return min(blocks)


def refusals(sched: Scheduler, limit: str) -> int:
    return sched.metrics.get("hyssm_admission_refusals_total", reason=REASONS[limit])


def case(limit: str, queued: int, prefix_len: int, rounds: int) -> dict[str, float | str]:
    sched = build(limit, queued, prefix_len, runner_new=rounds + 60)
    gc.collect()
    before = refusals(sched, limit)
    exhausted = time_rounds(sched, rounds)
    refused = refusals(sched, limit) - before
    per = max(1, rounds // 3)
    if refused < 3 * per or len(sched.waiting) != queued:
        raise AssertionError(f"{limit}: {refused} {REASONS[limit]} refusals in {3 * per} rounds, "
                             f"{len(sched.waiting)} of {queued} still queued: admission was not refused every round")
    # capacity returns: running requests end; the next round admits the queue's head first. What it
    # admits then holds what they held, so capacity is exhausted again until those end in turn.
    admit = []
    ending = ["runner0"]
    for _ in range(min(21, queued)):
        head = sched.waiting.peek()
        if head is None:
            break
        for rid in ending:
            sched.abort(rid)
        t0 = time.perf_counter()
        batch = sched.schedule()
        admit.append((time.perf_counter() - t0) * 1e6)
        admitted = [r.rid for r in batch.reqs if r.rid.startswith("q")] if batch is not None else []
        if admitted[:1] != [head.rid]:
            raise AssertionError(f"{limit}: capacity came back but the round admitted {admitted}, not {head.rid}")
        sched.apply_result(stub_step(batch))
        ending = admitted
    if queued <= 1000:
        sched.check_integrity()
    return {"limit": limit, "reason": REASONS[limit], "queued": queued, "prefix": prefix_len,
            "round_us": exhausted, "admit_round_us": statistics.median(admit)}  # fmt: skip


def run(limits: list[str], queued: list[int], prefixes: list[int], rounds: int) -> list[dict[str, float | str]]:
    results = []
    for limit in limits:
        for prefix_len in prefixes:
            base = time_rounds(build(limit, 0, prefix_len, runner_new=rounds + 60), rounds)
            for n in queued:
                r = case(limit, n, prefix_len, rounds)
                r["baseline_round_us"] = base
                r["admission_overhead_us"] = float(r["round_us"]) - base
                results.append(r)
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queued", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--prefix", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--limits", nargs="+", choices=sorted(REASONS), default=["state", "kv"])
    ap.add_argument("--json", action="store_true", help="print one JSON object per case")
    opts = ap.parse_args(argv)
    results = run(opts.limits, opts.queued, opts.prefix, opts.rounds)
    if opts.json:
        for r in results:
            print(json.dumps(r))
        return
    print(f"{'limit':>6} {'refusal':>12} {'queued':>7} {'prefix':>7} {'round µs':>10} {'empty-queue µs':>15} "
          f"{'queue cost µs':>14} {'admit µs (median)':>18}")  # fmt: skip
    for r in results:
        print(f"{r['limit']:>6} {r['reason']:>12} {r['queued']:>7} {r['prefix']:>7} {r['round_us']:>10.1f} "
              f"{r['baseline_round_us']:>15.1f} {r['admission_overhead_us']:>14.1f} {r['admit_round_us']:>18.1f}")
    worst = max(float(r["round_us"]) for r in results)
    print(f"worst round with capacity exhausted: {worst:.1f} µs (target <= 50 µs at 10k queued); "
          f"median {statistics.median(float(r['round_us']) for r in results):.1f} µs")


if __name__ == "__main__":
    main()
