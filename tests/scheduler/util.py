"""Helpers shared by the scheduler tests: model descriptions, scheduler + fake worker pairs, rounds."""

from __future__ import annotations

from typing import Any

from scheduler_proc.scheduler import Scheduler, SchedulerTuning
from shared.config import ServerArgs
from shared.messages import ForwardBatch, GenerateReq, SamplingParams, TokenOut
from shared.model_info import ModelInfo
from tests.scheduler.fake_worker import FakeWorker

ARCH = "GraniteMoeHybridForCausalLM"
HYBRID = ModelInfo(ARCH, ("mamba", "attention", "mamba"), 50, (), 4096)
ATTENTION_ONLY = ModelInfo(ARCH, ("attention", "attention"), 50, (), 4096)
# no attention layer (Mamba2): KV token slots are the scheduler's bookkeeping only, cached the same way
MAMBA_ONLY = ModelInfo("Mamba2ForCausalLM", ("mamba", "mamba"), 50, (), 4096)


def make(
    kv: int = 256,
    states: int = 8,
    model: ModelInfo = HYBRID,
    tuning: SchedulerTuning | None = None,
    **args: Any,
) -> tuple[Scheduler, FakeWorker]:
    args.setdefault("chunked_prefill_size", 64)
    args.setdefault("max_prefill_tokens", max(256, args["chunked_prefill_size"]))
    sched = Scheduler(ServerArgs(**args), model, kv, states if model.has_recurrent_state else 0, tuning)
    return sched, FakeWorker(kv, states if model.has_recurrent_state else 0, vocab=model.vocab_size)


def greq(rid: str, prompt: list[int], max_new: int, priority: int = 0, **sampling: Any) -> GenerateReq:
    sampling.setdefault("ignore_eos", True)
    sampling.setdefault("temperature", 0.0)
    return GenerateReq(
        rid=rid, input_ids=list(prompt), sampling=SamplingParams(max_new_tokens=max_new, **sampling), priority=priority
    )


def round_(sched: Scheduler, worker: FakeWorker, refused: frozenset[str] = frozenset()) -> tuple[
    ForwardBatch | None, list[TokenOut]
]:
    """One scheduling round: schedule, run, apply; integrity checked on both sides of the step."""
    batch = sched.schedule()
    sched.check_integrity()
    if batch is None:
        return None, []
    outs = sched.apply_result(worker.step(batch, refused))
    sched.check_integrity()
    return batch, outs


def rids(batch: ForwardBatch | None) -> list[str]:
    return [] if batch is None else [s.rid for s in batch.reqs]
