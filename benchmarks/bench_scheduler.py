"""Micro-benchmark of the scheduler's admission path (issue 4): cost of one scheduling round while
capacity stays exhausted, with 1k / 10k queued requests sharing a long prefix, and cost of the round
that admits when capacity returns. Pure CPU, no model: a stub worker answers every step.

Set-up per case: two Mamba state slots, one held by a running decode request, one by the cached state
of the shared prefix. Every queued prompt hits that state, and a hit needs two slots (its own copy and
the source it locks), so every round refuses the head of the queue (the latch is cleared every round:
hybrid model with a state cache). The round cost is schedule() + apply_result(); the same round with an
empty queue is the baseline, the difference is what the queue costs.

    python benchmarks/bench_scheduler.py [--queued 1000 10000] [--prefix 256 2048] [--rounds 3000]
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

from scheduler_proc.scheduler import Scheduler  # noqa: E402
from shared.config import ServerArgs  # noqa: E402
from shared.messages import ForwardBatch, GenerateReq, SamplingParams, StepResult  # noqa: E402
from shared.model_info import ModelInfo  # noqa: E402

MODEL = ModelInfo("GraniteMoeHybridForCausalLM", ("mamba", "attention"), 1000, (), 1 << 20)
SAMPLING = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.0)


def stub_step(batch: ForwardBatch) -> StepResult:
    return StepResult(step=batch.step, next_tokens={s.rid: 7 for s in batch.reqs if s.sample})


def drive(sched: Scheduler, rounds: int) -> None:
    for _ in range(rounds):
        batch = sched.schedule()
        if batch is not None:
            sched.apply_result(stub_step(batch))


def build(queued: int, prefix_len: int, runner_new: int) -> Scheduler:
    prefix = [(i * 7919) % 997 + 1 for i in range(prefix_len)]
    args = ServerArgs(chunked_prefill_size=4096, max_prefill_tokens=8192, max_running_requests=2)
    sched = Scheduler(args, MODEL, kv_capacity=prefix_len + 8 * runner_new + 4096, mamba_capacity=2)
    sched.add_request(GenerateReq(rid="donor", input_ids=prefix + [1], sampling=SamplingParams(max_new_tokens=1)))
    drive(sched, 4)  # the donor runs and donates the prefix state
    assert sched.cache.states_total == 1 and not sched.has_work
    runner = SamplingParams(max_new_tokens=runner_new, ignore_eos=True)
    sched.add_request(GenerateReq(rid="runner", input_ids=[5, 6, 7], sampling=runner))
    drive(sched, 2)
    for i in range(queued):
        sched.add_request(GenerateReq(rid=f"q{i}", input_ids=prefix + [1, 2 + i % 900], sampling=SAMPLING))
    return sched


def time_rounds(sched: Scheduler, rounds: int) -> float:
    """Mean µs per round (schedule + apply) over `rounds` rounds, best of 3 blocks."""
    blocks = []
    per = rounds // 3
    for _ in range(3):
        t0 = time.perf_counter()
        drive(sched, per)
        blocks.append((time.perf_counter() - t0) / per * 1e6)
    return min(blocks)


def case(queued: int, prefix_len: int, rounds: int) -> dict[str, float]:
    sched = build(queued, prefix_len, runner_new=rounds + 20)
    gc.collect()
    refusals0 = sched.metrics.get("hyssm_admission_refusals_total", reason="mamba_state")
    exhausted = time_rounds(sched, rounds)
    refused = sched.metrics.get("hyssm_admission_refusals_total", reason="mamba_state") - refusals0
    assert refused >= rounds // 3 * 3 and len(sched.waiting) == queued, "admission was not retried every round"
    # capacity returns (the running request ends, freeing its slot); the next round admits the head of
    # the queue with a copy-on-write of the prefix state. Repeated: the admitted request then holds the
    # slot, so capacity is exhausted again until it ends in turn.
    admit = []
    running = "runner"
    for i in range(min(51, queued)):
        sched.abort(running)
        t0 = time.perf_counter()
        batch = sched.schedule()
        admit.append((time.perf_counter() - t0) * 1e6)
        assert batch is not None and [r.rid for r in batch.reqs] == [f"q{i}"] and batch.copies
        sched.apply_result(stub_step(batch))
        running = f"q{i}"
    if queued <= 1000:
        sched.check_integrity()
    return {"queued": queued, "prefix": prefix_len, "round_us": exhausted, "admit_round_us": statistics.median(admit)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queued", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--prefix", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--json", action="store_true", help="print one JSON object per case")
    opts = ap.parse_args()
    results = []
    for prefix_len in opts.prefix:
        base = 0.0
        for queued in [0, *opts.queued]:
            if queued == 0:
                sched = build(0, prefix_len, runner_new=opts.rounds + 20)
                base = time_rounds(sched, opts.rounds)
                continue
            r = case(queued, prefix_len, opts.rounds)
            r["baseline_round_us"] = base
            r["admission_overhead_us"] = r["round_us"] - base
            results.append(r)
    if opts.json:
        for r in results:
            print(json.dumps(r))
        return
    print(f"{'queued':>7} {'prefix':>7} {'round µs':>10} {'empty-queue µs':>15} {'queue cost µs':>14} "
          f"{'admit µs (median)':>18}")  # fmt: skip
    for r in results:
        print(f"{r['queued']:>7} {r['prefix']:>7} {r['round_us']:>10.1f} {r['baseline_round_us']:>15.1f} "
              f"{r['admission_overhead_us']:>14.1f} {r['admit_round_us']:>18.1f}")  # fmt: skip
    worst = max(r["round_us"] for r in results)
    print(f"worst round with capacity exhausted: {worst:.1f} µs (target <= 50 µs at 10k queued); "
          f"median {statistics.median(r['round_us'] for r in results):.1f} µs")


if __name__ == "__main__":
    main()
