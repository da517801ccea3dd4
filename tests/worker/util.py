"""What the worker runtime tests share: fixture checkpoints and their references, runners, and
`ForwardBatch`es round-tripped through msgpack exactly as the scheduler -> worker channel does."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file

from shared.messages import CopyOp, ForwardBatch, ReqSlice, SamplingParams, ToWorker
from tests.model_driver import forward_all_logits, forward_logits
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
FIXTURE_NAMES = ("nope_groups2", "rope_moe", "blocktype_bias")  # GraniteMoeHybrid
FAMILY_FIXTURES = ("nemotron_h_dense", "nemotron_h_moe", "falcon_h1", "falcon_h1_nonorm", "bamba", "mamba2")
ALL_FIXTURES = FIXTURE_NAMES + FAMILY_FIXTURES
GDN_FIXTURES = ("qwen3_next_moe", "qwen3_5_dense", "qwen3_5_moe")  # Gated DeltaNet; prompts > 64 tokens
GREEDY = SamplingParams(temperature=0.0)
PLANS = tempfile.TemporaryDirectory(prefix="hyssm-test-plans-")
"""One measured execution plan per model shape for the whole run: two runners of one test run the same
product methods (a plan measured twice may pick another method, and so other roundings)."""


def fixture_dir(name: str) -> str:
    return os.path.join(FIXTURES, name)


def edit_config(model_dir: str, **changes: object) -> None:
    """Update keys of the checkpoint's config.json in place."""
    cfg_path = os.path.join(model_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(fixture_dir(name), "reference.safetensors"))


def runner(name: str, kv_slots: int = 96, state_slots: int = 8, **kw: object) -> ModelRunner:
    return runner_at(fixture_dir(name), kv_slots, state_slots, **kw)


def runner_at(model_dir: str, kv_slots: int = 96, state_slots: int = 8, **kw: object) -> ModelRunner:
    """A runner of the checkpoint in `model_dir` on the run's shared plans (PLANS)."""
    kw.setdefault("plan_cache_dir", Path(PLANS.name))
    return ModelRunner(model_dir, WorkerConfig(kv_slots=kv_slots, state_slots=state_slots, **kw))


def wire(batch: ForwardBatch) -> ForwardBatch:
    """Round-trip through msgpack exactly as the scheduler -> worker channel does."""
    out = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=ToWorker)
    assert isinstance(out, ForwardBatch)
    return out


def req(
    rid: str,
    ids: list[int],
    start: int,
    kv: list[int],
    mamba: int,
    sample: bool = True,
    sampling: SamplingParams | None = GREEDY,
    output_len: int = 0,
) -> ReqSlice:
    assert len(kv) == start + len(ids)
    return ReqSlice(rid=rid, input_ids=list(ids), start_pos=start, kv_slots=list(kv), state_slot=mamba,
                    sample=sample, sampling=sampling, output_len=output_len)


def batch(step: int, reqs: list[ReqSlice], copies: list[CopyOp] | None = None,
          clears: list[int] | None = None) -> ForwardBatch:
    return wire(ForwardBatch(step=step, reqs=reqs, copies=copies or [], clears=clears or []))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def chunked_prompt_logits(r: ModelRunner, prompt: list[int], chunks: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Every prompt row's logits, the prompt prefilled in `chunks` (one step each) over scattered KV slots."""
    kv = [5 + 2 * i for i in range(len(prompt))]  # scattered, non-contiguous KV slots
    rows, start = [], 0
    for step, c in enumerate(chunks):
        sl = req("a", prompt[start : start + c], start, kv[: start + c], 3)
        rows.append(forward_all_logits(r, batch(step, [sl], clears=[3] if start == 0 else []))["a"])
        start += c
    return torch.cat(rows)


def decode_logit_diffs(r: ModelRunner, prompt: list[int], gen: list[int], gen_logits: torch.Tensor) -> list[float]:
    """Max |logit difference| against `gen_logits[i]` at each step: the prompt's last row, then each
    decode step fed the reference's previous token."""
    n = len(prompt)
    kv = list(range(1, n + len(gen) + 1))
    logits = forward_logits(r, batch(0, [req("a", prompt, 0, kv[:n], 2)], clears=[2]))["a"]
    diffs = [max_diff(logits, gen_logits[0])]
    for i in range(1, len(gen)):
        pos = n + i - 1
        logits = forward_logits(r, batch(i, [req("a", [gen[i - 1]], pos, kv[: pos + 1], 2)]))["a"]
        diffs.append(max_diff(logits, gen_logits[i]))
    return diffs
