"""Tensor-parallel layout without processes: which heads/groups/channels a rank holds, the
start-up check of head counts, and that each rank's slice read from disk (safetensors
get_slice) is exactly that slice of the whole tensor."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from shared.errors import ModelLoadError
from shared.families.registry import parse_config
from shared.model_config import HybridConfig, tp_layout_error
from shared.model_info import read_config_json
from tests.worker.util import FAMILY_FIXTURES, FIXTURE_NAMES, fixture_dir
from worker_proc.loading.checkpoint import load_config
from worker_proc.loading.weight_files import load_weights, weight_files
from worker_proc.model import HybridForCausalLM, TPInfo
from worker_proc.model.tp import AttnShard, MambaShard
from worker_proc.state.pools import StatePools, slot_bytes


def _changed(cfg: HybridConfig, **parts: dict) -> HybridConfig:
    """`cfg` with fields of its parts changed: `_changed(cfg, mamba={"n_heads": 8})`."""
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in parts.items()})


def _cfg(name: str = "nope_groups2", **parts: dict) -> HybridConfig:
    return _changed(load_config(fixture_dir(name)), **parts)


def test_mamba_groups_divisible() -> None:
    cfg = _cfg(mamba={"n_heads": 8, "n_groups": 4})
    s0, s1 = MambaShard.of(cfg, 0, 2), MambaShard.of(cfg, 1, 2)
    assert (s0.head_start, s0.heads, s0.groups, s0.head_group) == (0, 4, (0, 1), None)
    assert (s1.head_start, s1.heads, s1.groups, s1.head_group) == (4, 4, (2, 3), None)
    assert not s0.norm_shared and s0.norm_groups == 2


def test_mamba_single_group_replicated() -> None:
    cfg = _cfg(mamba={"n_heads": 8, "n_groups": 1})
    for rank in range(4):
        s = MambaShard.of(cfg, rank, 4)
        assert (s.heads, s.groups, s.head_group, s.norm_shared) == (2, (0,), None, True)
        assert s.conv_dim == s.inner + 2 * cfg.mamba.d_state


def test_mamba_groups_spread_unevenly() -> None:
    cfg = _cfg(mamba={"n_heads": 6, "n_groups": 3, "intermediate": 6 * 16, "d_head": 16})
    s0, s1 = MambaShard.of(cfg, 0, 2), MambaShard.of(cfg, 1, 2)
    assert (s0.groups, s0.head_group) == ((0, 1), (0, 0, 1))  # heads 0,1,2 -> groups 0,0,1
    assert (s1.groups, s1.head_group) == ((1, 2), (0, 1, 1))  # heads 3,4,5 -> groups 1,2,2
    assert s0.norm_shared and s0.norm_group_size == 32


def test_attention_kv_heads_replicated_when_fewer_than_ranks() -> None:
    cfg = _cfg(attn={"num_heads": 8, "num_kv_heads": 2})
    shards = [AttnShard.of(cfg, r, 4) for r in range(4)]
    assert [(s.head_start, s.heads, s.kv_start, s.kv_heads) for s in shards] == [
        (0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)
    ]
    split = [AttnShard.of(cfg, r, 2) for r in range(2)]
    assert [(s.kv_start, s.kv_heads) for s in split] == [(0, 1), (1, 1)]


@pytest.mark.parametrize(
    ("changes", "tp", "needle"),
    [
        ({"attn": {"num_heads": 4}}, 3, "num_attention_heads 4"),
        ({"attn": {"num_heads": 6, "num_kv_heads": 3}}, 2, "num_key_value_heads 3"),
        ({"attn": {"num_heads": 12, "num_kv_heads": 3}}, 4, "not a multiple of num_key_value_heads 3"),
        ({"mamba": {"n_heads": 6}}, 4, "mamba_n_heads 6"),
    ],
)
def test_layout_errors(changes: dict, tp: int, needle: str) -> None:
    cfg = _cfg(attn={"num_heads": 8, "num_kv_heads": 4}, mamba={"n_heads": 8})
    assert tp_layout_error(cfg, 2) is None and tp_layout_error(cfg, 4) is None
    err = tp_layout_error(_changed(cfg, **changes), tp)
    assert err is not None and needle in err and f"--tp-size {tp}" in err


def test_layout_error_names_the_mlp_width() -> None:
    """An MLP width is the arrangement's (the family parsed it into the layer specs): the check names
    the config.json field that gave it."""
    raw = read_config_json(fixture_dir("nope_groups2"))
    cfg = parse_config({**raw, "num_attention_heads": 8, "num_key_value_heads": 4, "mamba_n_heads": 8,
                        "shared_intermediate_size": 90})  # fmt: skip
    err = tp_layout_error(cfg, 4)
    assert err is not None and "shared_intermediate_size 90" in err and "--tp-size 4" in err
    assert tp_layout_error(cfg, 2) is None


def test_layout_ok_and_model_refuses_bad_split() -> None:
    cfg = _cfg()
    assert tp_layout_error(cfg, 1) is None and tp_layout_error(cfg, 2) is None and tp_layout_error(cfg, 4) is None
    with pytest.raises(ModelLoadError, match="num_attention_heads"):
        HybridForCausalLM(cfg, torch.float32, "cpu", TPInfo(0, 3))


@pytest.mark.parametrize(("name", "tp"), [(n, 2) for n in FIXTURE_NAMES] + [("nope_groups2", 4), ("rope_moe", 4)])
def test_each_rank_loads_exactly_its_slice(name: str, tp: int) -> None:
    cfg = load_config(fixture_dir(name))
    assert tp_layout_error(cfg, tp) is None
    files = weight_files(fixture_dir(name))
    whole = load_file(next(iter(files)))
    total = 0
    for rank in range(tp):
        model = HybridForCausalLM(cfg, torch.float32, "cpu", TPInfo(rank, tp))
        load_weights(model, files)  # reads slices with get_slice
        params = dict(model.named_parameters())
        for key, tensor in whole.items():
            if key in params:
                assert torch.equal(params[key], model.shard_for_rank(key, tensor)), key
        total += sum(p.numel() for p in params.values())
    one = sum(p.numel() for p in HybridForCausalLM(cfg, torch.float32, "cpu").parameters())
    assert one < total < tp * one  # sharded tensors are split, the replicated ones repeat


def test_pools_sized_per_rank() -> None:
    cfg = _cfg()  # nope_groups2: 4 heads, 2 KV heads, 8 Mamba heads, 2 groups
    one = slot_bytes(cfg, torch.float32)
    two = slot_bytes(cfg, torch.float32, 2, 1)
    assert two.kv_token * 2 == one.kv_token and two.state_slot * 2 == one.state_slot
    four = slot_bytes(cfg, torch.float32, 4, 3)
    assert four.kv_token * 2 == one.kv_token  # one replicated KV head of two per rank
    p = StatePools(cfg, 4, 2, torch.float32, "cpu", 4, 3)
    shard = MambaShard.of(cfg, 3, 4)
    assert p.k.shape[2] == 1 and p.ssm.shape[2] == 2 and p.conv.shape[2] == shard.conv_dim
    p.check_integrity()


@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_family_ranks_load_exactly_their_slice(name: str) -> None:
    """Renamed and per-expert checkpoint tensors: every rank's parameter is its slice (by the block's
    shard_spec) of the whole TP=1 parameter, read directly from disk."""
    cfg = load_config(fixture_dir(name))
    files = weight_files(fixture_dir(name))
    whole = HybridForCausalLM(cfg, torch.float32, "cpu")
    load_weights(whole, files)
    full = dict(whole.named_parameters())
    sliced = 0
    for rank in range(2):
        model = HybridForCausalLM(cfg, torch.float32, "cpu", TPInfo(rank, 2))
        load_weights(model, files)
        for key, param in model.named_parameters():
            assert torch.equal(param, model.shard_for_rank(key, full[key])), key
            sliced += model.shard_spec(key) is not None
    assert sliced > 0
