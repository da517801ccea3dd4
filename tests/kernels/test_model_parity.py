"""Model level: `ModelRunner` with its ops replaced by `TritonOps` (interpreted) equals the reference path.

The runner keeps the ops object it got from its execution plan's kernel choice in `runner.ops`; the test swaps it for a
`TritonOps` (no change to the runtime) and runs the same ForwardBatches through both runners: a
mixed step (fresh prefill, a continued prefill chunk, decode rows), then decode steps, with every
row's logits and the whole state pools compared, and the fixture's Hugging Face logits checked too.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from shared.messages import CopyOp, ForwardBatch, ReqSlice, SamplingParams
from tests.kernels.util import TOL, max_diff
from tests.model_driver import forward_all_logits
from worker_proc.kernels import ReferenceOps
from worker_proc.kernels.triton.ops import TritonOps
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
GREEDY = SamplingParams(temperature=0.0)


def _runner(name: str, ops: object) -> ModelRunner:
    r = ModelRunner(os.path.join(FIXTURES, name), WorkerConfig(kv_slots=80, state_slots=6))
    assert isinstance(r.ops, ReferenceOps)  # what the plan chooses on CPU
    r.ops = ops
    return r


def _req(rid: str, ids: list[int], start: int, kv: list[int], mamba: int) -> ReqSlice:
    return ReqSlice(
        rid=rid, input_ids=ids, start_pos=start, kv_slots=kv[: start + len(ids)], state_slot=mamba,
        sample=True, sampling=GREEDY,
    )  # fmt: skip


def _same_step(a: ModelRunner, b: ModelRunner, fb: ForwardBatch) -> dict[str, torch.Tensor]:
    out_a, out_b = forward_all_logits(a, fb), forward_all_logits(b, fb)
    assert out_a.keys() == out_b.keys()
    for rid in out_a:
        assert max_diff(out_a[rid], out_b[rid]) <= TOL, f"request {rid}"
    for name in ("k", "v", "conv", "ssm"):
        pa, pb = getattr(a.pools, name), getattr(b.pools, name)
        # states accumulate to |x| ~ 50 in fp32: compare relative to their size (logits: absolute)
        assert max_diff(pa, pb) <= TOL * max(1.0, float(pb.abs().max())), f"{name} pool"
    a.check_integrity()
    b.check_integrity()  # padding slot 0 of every pool still zero
    return out_a


@pytest.mark.parametrize("name", ["nope_groups2"])  # the others add only model-side features (RoPE, MoE)
def test_mixed_steps_match_reference_path(name: str) -> None:
    ref = load_file(os.path.join(FIXTURES, name, "reference.safetensors"))
    prompt = ref["prompt"].tolist()
    n = len(prompt)
    tri, base = _runner(name, TritonOps()), _runner(name, ReferenceOps())
    kv_a = list(range(1, 40))
    kv_b = list(range(79, 40, -1))  # scattered, descending slots
    # step 0: request a's whole prompt, request b's first 6 tokens
    fb = ForwardBatch(step=0, reqs=[_req("a", prompt, 0, kv_a, 2), _req("b", prompt[:6], 0, kv_b, 5)], clears=[2, 5])
    out = _same_step(tri, base, fb)
    assert max_diff(out["a"], ref["prompt_logits"]) <= TOL  # and both equal Hugging Face
    # step 1: a decodes; b continues its prompt (chunk not aligned to mamba_chunk_size); c is a
    # copy-on-write of a's state (slot 3) that decodes one token right away
    gen0 = int(ref["gen_tokens"][0])
    fb = ForwardBatch(
        step=1,
        reqs=[
            _req("a", [gen0], n, kv_a, 2),
            _req("b", prompt[6:13], 6, kv_b, 5),
            _req("c", [gen0], n, kv_a[:n] + [60], 3),
        ],
        copies=[CopyOp(src=2, dst=3, rid="c")],
    )
    out = _same_step(tri, base, fb)
    assert max_diff(out["a"][0], ref["gen_logits"][1]) <= TOL
    assert max_diff(out["a"], out["c"]) <= TOL  # same history, different slots
    # step 2: everything decodes
    gen1 = int(ref["gen_tokens"][1])
    fb = ForwardBatch(
        step=2,
        reqs=[_req("a", [gen1], n + 1, kv_a, 2), _req("b", [prompt[13]], 13, kv_b, 5)],
    )
    out = _same_step(tri, base, fb)
    assert max_diff(out["a"][0], ref["gen_logits"][2]) <= TOL


def test_gated_deltanet_model_under_triton_ops_matches_hf() -> None:
    """A Gated DeltaNet model under `TritonOps` (its conv through the Triton conv kernels, the gated
    delta rule through the backend `gdn_ops` picks): prompt and decode logits equal Hugging Face's."""
    name = "qwen3_5_moe"
    ref = load_file(os.path.join(FIXTURES, name, "reference.safetensors"))
    prompt = ref["prompt"].tolist()
    n = len(prompt)
    r = ModelRunner(os.path.join(FIXTURES, name), WorkerConfig(kv_slots=n + 8, state_slots=2))
    r.ops = TritonOps()
    kv = list(range(1, n + 3))
    out = forward_all_logits(r, ForwardBatch(step=0, reqs=[_req("a", prompt, 0, kv, 1)], clears=[1]))
    assert max_diff(out["a"], ref["prompt_logits"]) <= TOL
    gen0 = int(ref["gen_tokens"][0])
    out = forward_all_logits(r, ForwardBatch(step=1, reqs=[_req("a", [gen0], n, kv, 1)]))
    assert max_diff(out["a"][0], ref["gen_logits"][1]) <= TOL
    r.check_integrity()
