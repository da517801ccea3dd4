"""TP=2 (and TP=4) against TP=1 on CPU with gloo: identical greedy tokens, logits within 1e-4
(fp32) at every step of a serving script (staggered arrivals, chunked prefill not aligned to the
SSD chunk, decode, a copy-on-write fork), identical logits on every rank, per-rank pools, and
the Hugging Face reference logits of the parity fixtures of every family (Granite, Nemotron-H
dense and MoE, Falcon-H1, Bamba, Mamba2: Mamba groups sharded, and replicated where a fixture has
one group; KV heads sharded, and replicated where a fixture has one; Qwen3-Next MoE and Qwen3.5
dense: Gated DeltaNet key/value heads, gated attention heads, experts and shared expert sharded)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shared.config import builtin_model_dir
from tests.tp.harness import model_traces, models_traces, run_ranks
from tests.tp.synth import make_checkpoint
from tests.worker.util import ALL_FIXTURES, fixture_dir, reference

pytestmark = pytest.mark.timeout(180)

TOL = 1e-4
N_NEW = 8
# n_groups 3 over 2 ranks: a rank's heads span groups unevenly and a norm group spans both ranks
GROUPS3_MOE = dict(
    hidden_size=48, mamba_n_heads=6, mamba_n_groups=3, mamba_d_head=16, mamba_expand=2,
    num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48,
    num_local_experts=3, num_experts_per_tok=2, attention_bias=True, mamba_proj_bias=True,
    tie_word_embeddings=False,
)
TP_GDN = ("qwen3_next_moe", "qwen3_5_dense")  # qwen3_5_moe has one key head: not splittable over 2 ranks
HF_FIXTURES = (*ALL_FIXTURES, *TP_GDN)
MODELS = (*HF_FIXTURES, "builtin", "groups3_moe")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str, int, list[int] | None]]:
    out: list[tuple[str, str, int, list[int] | None]] = [
        (name, fixture_dir(name), N_NEW, reference(name)["prompt"].tolist()) for name in HF_FIXTURES
    ]
    out.append(("builtin", builtin_model_dir(), N_NEW, None))
    synth = make_checkpoint(str(tmp_path_factory.mktemp("groups3_moe")), seed=3, **GROUPS3_MOE)
    out.append(("groups3_moe", synth, N_NEW, None))
    return out


@pytest.fixture(scope="module")
def tp1(jobs: list) -> dict[str, Any]:
    return models_traces(0, 1, None, jobs)


@pytest.fixture(scope="module")
def tp2(jobs: list) -> list[dict[str, Any]]:
    return run_ranks(models_traces, 2, (jobs,), timeout=120)


def _max_step_diff(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> float:
    assert len(a) == len(b)
    worst = 0.0
    for sa, sb in zip(a, b, strict=True):
        assert sa.keys() == sb.keys()
        worst = max([worst] + [float(np.abs(sa[k] - sb[k]).max()) for k in sa])
    return worst


def _compare(ref: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    tokens = ref["logits"].tokens
    assert ref["step"].tokens == tokens  # the script's two modes agree at TP=1
    for rank, res in enumerate(ranks):
        assert res["logits"].tokens == tokens, f"rank {rank}"
        assert res["step"].tokens == tokens, f"rank {rank}"
        assert _max_step_diff(ref["logits"].logits, res["logits"].logits) <= TOL
    for other in ranks[1:]:  # every rank computes the very same logits
        for s0, s1 in zip(ranks[0]["logits"].logits, other["logits"].logits, strict=True):
            assert all(np.array_equal(s0[k], s1[k]) for k in s0)


@pytest.mark.parametrize("name", MODELS)
def test_tp2_matches_tp1(name: str, tp1: dict[str, Any], tp2: list[dict[str, Any]]) -> None:
    _compare(tp1[name], [r[name] for r in tp2])


@pytest.mark.parametrize("name", HF_FIXTURES)
def test_tp2_prompt_logits_match_hf(name: str, tp2: list[dict[str, Any]]) -> None:
    ref = reference(name)["prompt_logits"].numpy()
    for r in tp2:
        assert float(np.abs(r[name]["prompt_logits"] - ref).max()) <= TOL


@pytest.mark.parametrize("name", MODELS)
def test_tp2_pools_are_per_rank(name: str, tp1: dict[str, Any], tp2: list[dict[str, Any]]) -> None:
    kv, mamba, nbytes = tp1[name]["capacity"]
    for r in tp2:
        r_kv, r_mamba, r_bytes = r[name]["capacity"]
        assert (r_kv, r_mamba) == (kv, mamba)
        assert r_bytes < nbytes * 0.75  # heads / 2 (a replicated KV head or B/C group costs a little more)


def test_tp4_replicated_kv_heads_and_spanning_norm_groups() -> None:
    """nope_groups2 over 4 ranks: 2 KV heads each held by 2 ranks, 2 norm groups over 4 ranks."""
    name = "nope_groups2"
    job = [(name, fixture_dir(name), 4, reference(name)["prompt"].tolist())]
    ref = models_traces(0, 1, None, job)[name]
    ranks = [r[name] for r in run_ranks(models_traces, 4, (job,), timeout=120)]
    _compare(ref, ranks)
    hf = reference(name)["prompt_logits"].numpy()
    assert float(np.abs(ranks[0]["prompt_logits"] - hf).max()) <= TOL


def test_single_rank_trace_is_unchanged_by_the_harness() -> None:
    """The TP=1 reference itself matches the HF fixture (the comparisons above are anchored)."""
    name = "rope_moe"
    res = model_traces(0, 1, None, fixture_dir(name), 2, reference(name)["prompt"].tolist())
    assert float(np.abs(res["prompt_logits"] - reference(name)["prompt_logits"].numpy()).max()) <= TOL
