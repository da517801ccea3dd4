"""Parity with transformers for Mamba1 (Mamba, FalconMamba, Jamba; checkpoints built by transformers at test time,
tests/fixtures/mamba1_model.py), through ModelRunner with msgpack round-tripped batches, in the default and
the deterministic mode: all-position prompt logits, chunked prefill resuming from the pooled conv window and
per-channel SSM state (a one-token chunk taking the decode path mid-prompt, one-token chunks at the very
start), per-step decode logits and greedy tokens, a prefix hit (the cached state copied on write) against
the uninterrupted prompt, drafts verified with the state rolled back to the accepted tokens, and the state
stored as bfloat16 / int8 (`--mamba-ssm-dtype`). Tolerance: 1e-4 max abs logit difference (fp32).
"""

from __future__ import annotations

import pytest
import torch

from shared.families.registry import parse_config
from shared.model_info import ModelInfo, read_config_json
from tests.fixtures.mamba1_model import MAMBA1_CONFIGS, mamba1_dir
from tests.model_driver import generate_greedy
from tests.worker.family_parity import (
    check_chunked_prefill_logits,
    check_decode_logits_and_greedy_tokens,
    check_drafts_roll_back_the_state,
    check_full_prompt_logits,
    check_prefix_hit_copy_on_write,
    family_reference,
    family_runner,
)
from tests.worker.util import decode_logit_diffs

TOL = 1e-4
NAMES = tuple(MAMBA1_CONFIGS)
CONV, SSM = "mamba1_conv", "mamba1_ssm"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_full_prompt_logits(name: str, deterministic: bool) -> None:
    r = check_full_prompt_logits(mamba1_dir(name), deterministic, TOL)
    info = ModelInfo.from_dir(mamba1_dir(name))  # what the scheduler and /get_model_info know of the model
    assert info.has_recurrent_state and info.has_attention == (name == "jamba")
    assert info.state_kinds == {"mamba1": "conv window + per-channel SSM state"}
    cfg = parse_config(read_config_json(mamba1_dir(name)))
    states = r.pools.states[SSM]
    layers = len(cfg.mamba1_layer_ids)
    assert states.shape == (layers, r.pools.state_capacity + 1, cfg.mamba1.d_inner, cfg.mamba1.d_state)
    assert states[:, 1].abs().sum() > 0 and r.pools.states[CONV][:, 1].abs().sum() > 0


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chunks", [[5, 1, 13], [1, 1, 7, 10], [9, 2, 8]])
def test_chunked_prefill_logits(name: str, chunks: list[int], deterministic: bool) -> None:
    check_chunked_prefill_logits(mamba1_dir(name), chunks, deterministic, TOL)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_decode_logits_and_greedy_tokens(name: str, deterministic: bool) -> None:
    check_decode_logits_and_greedy_tokens(mamba1_dir(name), deterministic, TOL)


@pytest.mark.parametrize("name", NAMES)
def test_prefix_hit_copy_on_write_equals_uninterrupted(name: str) -> None:
    """A cached prefix's state (slot 1) copied on write into a new request's slot resumes exactly as the
    uninterrupted prompt; the source slot is left as it was."""
    check_prefix_hit_copy_on_write(mamba1_dir(name), (CONV, SSM), TOL)


@pytest.mark.parametrize("name", NAMES)
def test_drafts_give_the_greedy_output_and_its_state(name: str) -> None:
    """Drafts right for a varying number of tokens, then wrong: the output is greedy decoding's and the conv
    windows and SSM states after every step are those of exactly the accepted tokens (bitwise,
    deterministic mode)."""
    check_drafts_roll_back_the_state(mamba1_dir(name), (CONV, SSM))


STATE_DTYPE_TOL = {"bfloat16": 0.06, "int8": 0.13}
"""Max abs logit difference over the decode steps against the float32 reference (logits of magnitude ~6;
measured: bf16 <= 0.041, int8 <= 0.102 with one scale per channel)."""


@pytest.mark.parametrize("state_dtype", tuple(STATE_DTYPE_TOL))
@pytest.mark.parametrize("name", NAMES)
def test_state_dtype(name: str, state_dtype: str) -> None:
    """The per-channel SSM state stored as bfloat16 or int8 (one scale per channel): the pool holds that
    type (and the int8 scales), the conv window stays in the model dtype, and decode stays close to the
    float32 reference with the same greedy tokens."""
    ref = family_reference(mamba1_dir(name))
    prompt, gen = ref["prompt"].tolist(), ref["gen_tokens"].tolist()
    r = family_runner(mamba1_dir(name), state_dtype=state_dtype)
    diffs = decode_logit_diffs(r, prompt, gen, ref["gen_logits"])
    assert 0 < max(diffs) <= STATE_DTYPE_TOL[state_dtype], diffs
    pools = r.pools.states
    assert pools[SSM].dtype == {"bfloat16": torch.bfloat16, "int8": torch.int8}[state_dtype]
    assert pools[CONV].dtype == torch.float32
    assert (SSM + "_scale" in pools) == (state_dtype == "int8")
    r.check_integrity()
    assert generate_greedy(family_runner(mamba1_dir(name), state_dtype=state_dtype), prompt, len(gen)) == gen


def test_hub_config_fields() -> None:
    """The hub's spellings (`expand` without `intermediate_size`, `time_step_rank` "auto", the old
    `backbone.embedding` name) give the sizes transformers builds from the same config.json."""
    transformers = pytest.importorskip("transformers")
    raw = dict(read_config_json(mamba1_dir("mamba_k3")), expand=3, time_step_rank="auto", hidden_size=80)
    raw.pop("intermediate_size")
    cfg = parse_config(raw)
    hf = transformers.MambaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    assert cfg.mamba1.d_inner == hf.intermediate_size == 240
    assert cfg.mamba1.dt_rank == hf.time_step_rank == 5
    assert cfg.mamba1.bcdt_norm == "" and cfg.layer_kinds == ("mamba1",) * 2
    falcon = parse_config(read_config_json(mamba1_dir("falcon_mamba")))
    assert falcon.mamba1.bcdt_norm == "weightless" and falcon.mamba1.norm_eps == 1e-6
    rename = dict(cfg.renames)
    assert r"^model\.embeddings?\." in rename


@pytest.mark.parametrize("attn, experts", [((8, 4), (2, 1)), ((3, 0), (1, 0)), ((5, 4), (3, 2))])
def test_jamba_layout_matches_transformers(attn: tuple[int, int], experts: tuple[int, int]) -> None:
    """Attention and MoE layers where transformers' JambaConfig puts them (`layers_block_type`,
    `layers_num_experts`) for periods and offsets other than the fixture's."""
    transformers = pytest.importorskip("transformers")
    raw = dict(read_config_json(mamba1_dir("jamba")), num_hidden_layers=10, attn_layer_period=attn[0],
               attn_layer_offset=attn[1], expert_layer_period=experts[0], expert_layer_offset=experts[1])
    cfg = parse_config(raw)
    hf = transformers.JambaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    assert cfg.layer_kinds == tuple("mamba1" if k == "mamba" else k for k in hf.layers_block_type)
    moe = tuple(layer[1].blocks[0].kind == "shared_gate_moe" for layer in cfg.layers())
    assert moe == tuple(n > 1 for n in hf.layers_num_experts)
    assert cfg.mamba1.bcdt_norm == "weighted" and not cfg.moe.norm_topk_prob and cfg.attn.rope_theta is None
