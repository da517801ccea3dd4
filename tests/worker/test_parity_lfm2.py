"""Parity with transformers for LFM2 and LFM2-MoE (gated short convolutions + GQA attention; checkpoints built by
transformers at test time, tests/fixtures/lfm2_model.py), through ModelRunner with msgpack
round-tripped batches, in the default and the deterministic mode: all-position prompt logits,
chunked prefill resuming from the pooled conv window (a one-token chunk taking the decode path
mid-prompt, one-token chunks at the very start), per-step decode logits and greedy tokens, a prefix
hit (the cached state copied on write) against the uninterrupted prompt, and drafts verified with
the conv window rolled back to the accepted tokens. Tolerance: 1e-4 max abs logit difference (fp32).
"""

from __future__ import annotations

import pytest

from shared.families.registry import parse_config
from shared.model_info import ModelInfo, read_config_json
from tests.fixtures.lfm2_model import LFM2_CONFIGS, lfm2_dir
from tests.worker.family_parity import (
    check_chunked_prefill_logits,
    check_decode_logits_and_greedy_tokens,
    check_drafts_roll_back_the_state,
    check_full_prompt_logits,
    check_prefix_hit_copy_on_write,
)

TOL = 1e-4
NAMES = tuple(LFM2_CONFIGS)
WINDOW = "short_conv_window"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_full_prompt_logits(name: str, deterministic: bool) -> None:
    r = check_full_prompt_logits(lfm2_dir(name), deterministic, TOL)
    windows = r.pools.states[WINDOW]
    info = ModelInfo.from_dir(lfm2_dir(name))  # what the scheduler and /get_model_info know of the model
    assert info.has_recurrent_state and info.state_kinds == {"short_conv": "conv window"}
    assert windows.shape[0] == info.layer_kinds.count("short_conv") > 0
    assert windows[:, 1].abs().sum() > 0  # the slot's conv windows hold the prompt's last inputs


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chunks", [[5, 1, 13], [1, 1, 7, 10], [9, 2, 8]])
def test_chunked_prefill_logits(name: str, chunks: list[int], deterministic: bool) -> None:
    check_chunked_prefill_logits(lfm2_dir(name), chunks, deterministic, TOL)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_decode_logits_and_greedy_tokens(name: str, deterministic: bool) -> None:
    check_decode_logits_and_greedy_tokens(lfm2_dir(name), deterministic, TOL)


@pytest.mark.parametrize("name", NAMES)
def test_prefix_hit_copy_on_write_equals_uninterrupted(name: str) -> None:
    """A cached prefix's state (slot 1) copied on write into a new request's slot resumes exactly as the
    uninterrupted prompt; the source slot is left as it was."""
    r = check_prefix_hit_copy_on_write(lfm2_dir(name), (WINDOW,), TOL)
    assert set(r.pools.states) >= {WINDOW}  # the window is the whole recurrent state of an LFM2 slot


@pytest.mark.parametrize("name", NAMES)
def test_drafts_give_the_greedy_output_and_its_conv_window(name: str) -> None:
    """Drafts right for a varying number of tokens, then wrong: the output is greedy decoding's and the
    conv windows after every step are those of exactly the accepted tokens (bitwise, deterministic mode)."""
    check_drafts_roll_back_the_state(lfm2_dir(name), (WINDOW,))


def test_hub_config_fields() -> None:
    """The hub's spellings (block_ff_dim, tie_embedding, top-level rope_theta, full_attn_idxs) give the
    sizes transformers builds from the same config.json."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    raw = dict(read_config_json(lfm2_dir("lfm2_bias")), block_ff_dim=1000, tie_embedding=False, rope_theta=5e5,
               block_ffn_dim_multiplier=1.5, block_multiple_of=64, full_attn_idxs=[1, 2])
    raw.pop("layer_types"), raw.pop("rope_parameters"), raw.pop("intermediate_size"), raw.pop("tie_word_embeddings")
    cfg = parse_config(raw)
    hf = transformers.Lfm2Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    assert cfg.blocks()[1].size == Lfm2MLP(hf).w1.out_features == 1024
    assert cfg.layer_kinds == ("short_conv", "attention", "attention", "short_conv")
    assert cfg.tie_word_embeddings is hf.tie_word_embeddings is False
    assert cfg.attn.rope_theta == hf.rope_parameters["rope_theta"] == 5e5
