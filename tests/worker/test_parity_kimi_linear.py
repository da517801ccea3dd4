"""Parity with transformers for Kimi Linear (Kimi Delta Attention + NoPE MLA + grouped MoE; checkpoints built by
transformers at test time, tests/fixtures/kimi_linear_model.py), through ModelRunner with msgpack
round-tripped batches, in the default and the deterministic mode: all-position prompt logits,
chunked prefill resuming from the pooled conv windows and delta-rule state (a one-token chunk taking
the decode path mid-prompt, one-token chunks at the very start), per-step decode logits and greedy
tokens, a prefix hit (the cached state copied on write) against the uninterrupted prompt, and drafts
verified with the state rolled back to the accepted tokens. Tolerance: 1e-4 max abs logit difference (fp32).
"""

from __future__ import annotations

import pytest

from shared.errors import ModelLoadError
from shared.families.registry import parse_config
from shared.model_info import ModelInfo, read_config_json
from tests.fixtures.kimi_linear_model import KIMI_CONFIGS, kimi_dir
from tests.worker.family_parity import (
    check_chunked_prefill_logits,
    check_decode_logits_and_greedy_tokens,
    check_drafts_roll_back_the_state,
    check_full_prompt_logits,
    check_prefix_hit_copy_on_write,
    family_reference,
)

TOL = 1e-4
NAMES = tuple(KIMI_CONFIGS)
STATE, WINDOW = "kda_state", "kda_conv"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_full_prompt_logits(name: str, deterministic: bool) -> None:
    r = check_full_prompt_logits(kimi_dir(name), deterministic, TOL)
    n = len(family_reference(kimi_dir(name))["prompt"])
    states = r.pools.states[STATE]
    info = ModelInfo.from_dir(kimi_dir(name))  # what the scheduler and /get_model_info know of the model
    assert info.has_recurrent_state and info.has_attention
    assert info.state_kinds == {"kda": "conv window + delta-rule state (per-channel decay)"}
    assert states.shape[0] == info.layer_kinds.count("kda") > 0
    assert states[:, 1].abs().sum() > 0 and r.pools.states[WINDOW][:, 1].abs().sum() > 0
    spec = KIMI_CONFIGS[name]  # MLA caches one latent row per token, [normed latent | shared key], read as V too
    assert r.pools.k.shape[-2:] == (1, spec["kv_lora_rank"] + spec["qk_rope_head_dim"]) and r.pools.v.shape[-1] == 0
    latent, shared = r.pools.k[:, 1:n + 1].split([spec["kv_lora_rank"], spec["qk_rope_head_dim"]], dim=-1)
    assert latent.any() and shared.any()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chunks", [[5, 1, 13], [1, 1, 7, 10], [9, 2, 8]])
def test_chunked_prefill_logits(name: str, chunks: list[int], deterministic: bool) -> None:
    check_chunked_prefill_logits(kimi_dir(name), chunks, deterministic, TOL)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_decode_logits_and_greedy_tokens(name: str, deterministic: bool) -> None:
    check_decode_logits_and_greedy_tokens(kimi_dir(name), deterministic, TOL)


@pytest.mark.parametrize("name", NAMES)
def test_prefix_hit_copy_on_write_equals_uninterrupted(name: str) -> None:
    """A cached prefix's state (slot 1) copied on write into a new request's slot resumes exactly as the
    uninterrupted prompt; the source slot is left as it was."""
    check_prefix_hit_copy_on_write(kimi_dir(name), (STATE, WINDOW), TOL)


@pytest.mark.parametrize("name", NAMES)
def test_drafts_give_the_greedy_output_and_its_state(name: str) -> None:
    """Drafts right for a varying number of tokens, then wrong: the output is greedy decoding's and the
    conv windows and delta-rule state after every step are those of exactly the accepted tokens
    (bitwise, deterministic mode)."""
    check_drafts_roll_back_the_state(kimi_dir(name), (STATE, WINDOW))


def test_hub_config_fields() -> None:
    """The hub's spellings (transformers' attribute_map names, the 1-indexed linear_attn_config lists, no
    layer_types) give the layout and sizes transformers builds from the same config.json."""
    transformers = pytest.importorskip("transformers")

    raw = dict(read_config_json(kimi_dir("kimi_moe")))
    raw.pop("layer_types"), raw.pop("mlp_layer_types")
    raw["linear_attn_config"] = dict(raw["linear_attn_config"], full_attn_layers=[3], kda_layers=[1, 2, 4])
    cfg = parse_config(raw)
    hf = transformers.KimiLinearConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    kinds = {"linear_attention": "kda", "full_attention": "attention"}
    assert cfg.layer_kinds == tuple(kinds[t] for t in hf.layer_types) == ("kda", "kda", "attention", "kda")
    assert [b.kind for b in cfg.blocks()][1::2] == ["gated_mlp"] + ["grouped_swiglu_moe"] * 3
    assert (cfg.moe.num_experts, cfg.moe.experts_per_tok, cfg.moe.n_group) == (hf.num_local_experts,
                                                                               hf.num_experts_per_tok, hf.n_group)
    assert cfg.kda.heads == hf.linear_num_heads and cfg.attn.scale == hf.qk_head_dim**-0.5
    assert cfg.tie_word_embeddings is False
    for field, value in (("mla_use_nope", False), ("moe_router_activation_func", "softmax")):
        with pytest.raises(ModelLoadError, match=field):
            parse_config(dict(raw, **{field: value}))
