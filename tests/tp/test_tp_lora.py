"""LoRA adapters under tensor parallelism (TP=2 on CPU with gloo): every rank's prompt and decode logits within
1e-4 (fp32) of `PeftModel.from_pretrained` and identical greedy tokens, the ranks' logits identical. The
adapters cover column-parallel layers whose B rows are sliced in one range (q/k/v, gate/up) or several (Mamba
in_proj's z | x | B | C | dt, Granite's fused input_linear gate | up halves, Qwen3-Next's in_proj_qkvz grouped
by key head, Qwen3.5's in_proj_qkv), row-parallel ones whose A columns are sliced and whose partial terms meet
in the base all-reduce (o_proj, out_proj, down_proj, output_linear), KV heads sharded and replicated, and
layers every rank holds whole (Nemotron's latent projections, Qwen's shared expert gate)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shared.messages import LoraLoad
from shared.messages.lora import LoraAdapter
from tests.tp.harness import KV_SLOTS, MAMBA_SLOTS, run_ranks
from tests.worker.lora_util import adapter_of, make_adapter, peft_reference, serve_one
from tests.worker.util import fixture_dir, reference
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

pytestmark = pytest.mark.timeout(300)

TOL = 1e-4
STEPS = 4
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
CASES: dict[str, list[str]] = {
    "nope_groups2": [*ATTN, "in_proj", "out_proj", "input_linear", "output_linear"],
    "falcon_h1": [*ATTN, "in_proj", "gate_proj", "up_proj", "down_proj"],
    "falcon_h1_nonorm": ["k_proj", "v_proj", "in_proj"],  # one KV head: replicated on both ranks
    "bamba": ["in_proj", "out_proj", "o_proj", "down_proj"],
    "nemotron_h_moe": ["in_proj", "q_proj", "up_proj", "down_proj", "fc1_latent_proj", "fc2_latent_proj"],
    "qwen3_next_moe": ["in_proj_qkvz", "in_proj_ba", "out_proj", *ATTN, "shared_expert_gate"],
    "qwen3_5_dense": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", *ATTN, "gate_proj",
                      "down_proj"],
}


def serve_ranks(rank: int, size: int, group: Any, jobs: list[tuple[str, LoraAdapter, list[int]]]) -> dict:
    """Each job's request under its adapter on this rank: (prompt logits, tokens, decode logits)."""
    out = {}
    for name, adapter, prompt in jobs:
        r = ModelRunner(fixture_dir(name), WorkerConfig(dtype="float32", kv_slots=KV_SLOTS, state_slots=MAMBA_SLOTS,
                                                        tp_rank=rank, tp_size=size, max_loras=2, deterministic=True),
                       tp_group=group)
        logits, tokens, decode = serve_one(r, prompt, STEPS, 2, [LoraLoad(slot=2, adapter=adapter)])
        r.check_integrity()
        out[name] = (logits.numpy(), tokens, [d.numpy() for d in decode])
    return out


def test_tp2_adapters_match_peft(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("tp_adapters")
    jobs, refs = [], {}
    for i, (name, targets) in enumerate(CASES.items()):
        path = make_adapter(fixture_dir(name), str(root / name), targets, seed=20 + i)
        prompt = reference(name)["prompt"].tolist()
        refs[name] = peft_reference(fixture_dir(name), path, prompt, STEPS)
        jobs.append((name, adapter_of(name, path), prompt))
    ranks = run_ranks(serve_ranks, 2, (jobs,), timeout=240)
    for name, (ref_logits, ref_tokens, ref_decode) in refs.items():
        (l0, t0, d0), (l1, t1, d1) = ranks[0][name], ranks[1][name]
        same = np.array_equal(l0, l1) and all(np.array_equal(a, b) for a, b in zip(d0, d1, strict=True))
        assert same and t0 == t1, name  # every rank computes the same logits
        assert np.abs(l0 - ref_logits.numpy()).max() <= TOL, name
        assert t0 == ref_tokens, name
        assert max(np.abs(a - b.numpy()).max() for a, b in zip(d0, ref_decode, strict=True)) <= TOL, name
