"""State pools: layout, capacity planning, slot ops and their range checks."""

from __future__ import annotations

import pytest
import torch

from shared.config import builtin_model_dir
from tests.worker.util import fixture_dir
from worker_proc.loading.checkpoint import load_config
from worker_proc.state.pools import DEFAULT_CPU_BUDGET_BYTES, StatePools, plan_capacities, pool_budget, slot_bytes


def _cfg():
    return load_config(fixture_dir("nope_groups2"))


def test_layout() -> None:
    cfg = _cfg()
    p = StatePools(cfg, kv_slots=10, state_slots=3, dtype=torch.float32, device="cpu")
    assert p.k.shape == (2, 11, cfg.attn.num_kv_heads, cfg.attn.head_dim) == p.v.shape
    assert p.conv.shape == (2, 4, cfg.mamba.conv_dim, cfg.mamba.d_conv - 1)
    assert p.ssm.shape == (2, 4, cfg.mamba.n_heads, cfg.mamba.d_head, cfg.mamba.d_state)
    assert p.ssm.dtype == torch.float32
    p16 = StatePools(cfg, kv_slots=2, state_slots=2, dtype=torch.bfloat16, device="cpu")
    assert p16.k.dtype == p16.conv.dtype == torch.bfloat16 and p16.ssm.dtype == torch.float32
    p.check_integrity()


def test_plan_capacities_splits_budget() -> None:
    cfg = _cfg()
    sb = slot_bytes(cfg, torch.float32)
    assert sb.kv_token == 2 * 2 * cfg.attn.num_kv_heads * cfg.attn.head_dim * 4
    budget = 10_000_000
    kv, mamba = plan_capacities(cfg, budget, 0.25, torch.float32)
    assert kv == int(budget * 0.75) // sb.kv_token - 1
    assert mamba == int(budget * 0.25) // sb.state_slot - 1
    assert (kv + 1) * sb.kv_token + (mamba + 1) * sb.state_slot <= budget
    p = StatePools(cfg, kv, mamba, torch.float32, "cpu")
    assert p.nbytes() <= budget
    with pytest.raises(ValueError, match="too small"):
        plan_capacities(cfg, 1000, 0.5, torch.float32)
    with pytest.raises(ValueError, match="state_ratio"):
        plan_capacities(cfg, budget, 1.0, torch.float32)


def test_copy_and_clear() -> None:
    p = StatePools(_cfg(), kv_slots=4, state_slots=3, dtype=torch.float32, device="cpu")
    p.conv[:, 1].normal_()
    p.ssm[:, 1].normal_()
    p.copy_state(1, 2)
    assert torch.equal(p.conv[:, 2], p.conv[:, 1]) and torch.equal(p.ssm[:, 2], p.ssm[:, 1])
    p.ssm[:, 2].add_(1.0)  # writing the copy leaves the source alone
    assert not torch.equal(p.ssm[:, 2], p.ssm[:, 1])
    p.clear_state(1)
    assert not p.conv[:, 1].any() and not p.ssm[:, 1].any() and p.ssm[:, 2].any()
    for bad in (0, 4, -1):
        with pytest.raises(ValueError):
            p.copy_state(bad, 2)
        with pytest.raises(ValueError):
            p.clear_state(bad)
    p.check_integrity()


def test_attention_only_and_mamba_only_budgets() -> None:
    cfg = _cfg()
    from dataclasses import replace

    attn_only = replace(cfg, layer_kinds=("attention",) * 4)
    kv, mamba = plan_capacities(attn_only, 1_000_000, 0.5, torch.float32)
    assert mamba == 0 and kv == 1_000_000 // slot_bytes(attn_only, torch.float32).kv_token - 1
    mamba_only = replace(cfg, layer_kinds=("mamba",) * 4)
    kv, mamba = plan_capacities(mamba_only, 1_000_000, 0.5, torch.float32)
    assert kv == 0 and mamba == 1_000_000 // slot_bytes(mamba_only, torch.float32).state_slot - 1


def test_attention_free_model_has_no_kv_memory() -> None:
    """Mamba2: no KV tensor at all; the token slots reported are --max-total-tokens when given, else
    enough for every state slot to hold a full context (bookkeeping only)."""
    from tests.worker.util import runner
    from worker_proc.state.pools import attention_free_kv_slots

    r = runner("mamba2", kv_slots=0, state_slots=4)
    assert r.pools.k.numel() == 0 and r.pools.v.numel() == 0
    assert r.kv_capacity == attention_free_kv_slots(0, 4, 512) == 4 * 512
    assert runner("mamba2", kv_slots=100, state_slots=4).kv_capacity == 100
    assert attention_free_kv_slots(0, 10**6, 512) == 1 << 20  # capped: the scheduler's tree stays bounded
    assert attention_free_kv_slots(0, 1, 1 << 21) == 1 << 21  # never less than one context
    r.check_integrity()


def test_pool_budget_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """--mem-budget-gb wins on any device; CPU has its documented default; CUDA follows
    --mem-fraction-static: weights + pools within that share of the total, measured after loading."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    assert pool_budget(cpu, 0, 0.85) == (DEFAULT_CPU_BUDGET_BYTES, "the CPU default")
    assert pool_budget(cpu, 123_456, 0.85)[0] == 123_456
    gib = 2**30
    asked: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 60 * gib, 100 * gib  # 40 GiB taken (weights, other processes)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert pool_budget(gpu, 7 * gib, 0.85)[0] == 7 * gib and not asked  # the override measures nothing
    budget, how = pool_budget(gpu, 0, 0.85)
    assert budget == 45 * gib and asked == [gpu] and "--mem-fraction-static 0.85" in how
    assert pool_budget(gpu, 0, 0.5)[0] == 10 * gib
    with pytest.raises(ValueError, match="--mem-fraction-static 0.3 leaves no memory"):
        pool_budget(gpu, 0, 0.3)


def test_cpu_default_grows_with_the_running_requests_states(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker_proc.state import pools

    cfg = load_config(builtin_model_dir())
    cpu = torch.device("cpu")
    monkeypatch.setattr(pools, "available_ram_bytes", lambda: 64 << 30)
    state = slot_bytes(cfg, torch.float32).state_slot
    wanted = pools.cpu_wanted_budget(cfg, torch.float32, 4000, 0.5)
    assert wanted == int((4000 + 1000 + 2) * state / 0.5)
    budget, how = pool_budget(cpu, 0, 0.85, wanted)
    assert budget == wanted and "max-running-requests" in how
    _, mamba = plan_capacities(cfg, budget, 0.5, torch.float32)
    assert mamba >= 4000 + 1000  # every running request has a state slot, with room for cached ones
    assert pool_budget(cpu, 0, 0.85, 1000)[0] == DEFAULT_CPU_BUDGET_BYTES  # never below the floor
    monkeypatch.setattr(pools, "available_ram_bytes", lambda: 2 << 30)
    budget, how = pool_budget(cpu, 0, 0.85, wanted)
    assert budget == (2 << 30) // 4 and "capped" in how  # at most a quarter of the available RAM


def test_gated_deltanet_state_layout_bytes_and_slot_ops() -> None:
    """A Gated DeltaNet hybrid declares its own state tensors (conv window in the model dtype, the
    [Hv, Dk, Dv] recurrent state in float32); one state slot holds all of them, slot_bytes counts
    exactly what the pools allocate per slot, and copy/clear/check_integrity cover them."""
    cfg = load_config(fixture_dir("qwen3_next_moe"))
    n_gdn = len(cfg.gdn_layer_ids)
    conv_dim = 2 * cfg.gdn.k_heads * cfg.gdn.k_dim + cfg.gdn.v_heads * cfg.gdn.v_dim
    p = StatePools(cfg, kv_slots=6, state_slots=3, dtype=torch.bfloat16, device="cpu")
    assert p.states["gdn_conv"].shape == (n_gdn, 4, conv_dim, cfg.gdn.d_conv - 1)
    assert p.states["gdn_state"].shape == (n_gdn, 4, cfg.gdn.v_heads, cfg.gdn.k_dim, cfg.gdn.v_dim)
    assert p.states["gdn_conv"].dtype == torch.bfloat16 and p.states["gdn_state"].dtype == torch.float32
    assert p.conv.numel() == 0 and p.ssm.numel() == 0  # no Mamba layer
    grown = StatePools(cfg, kv_slots=6, state_slots=4, dtype=torch.bfloat16, device="cpu")
    per_slot = slot_bytes(cfg, torch.bfloat16).state_slot
    recurrent = cfg.gdn.v_heads * cfg.gdn.k_dim * cfg.gdn.v_dim * 4
    assert per_slot == n_gdn * (conv_dim * (cfg.gdn.d_conv - 1) * 2 + recurrent)
    assert grown.nbytes() - p.nbytes() == per_slot
    half = slot_bytes(cfg, torch.bfloat16, tp_size=2, tp_rank=1).state_slot
    assert half * 2 == per_slot  # heads sharded: each rank holds half of every state tensor
    kv, states = plan_capacities(cfg, 4_000_000, 0.5, torch.bfloat16)
    assert states == 2_000_000 // per_slot - 1
    for pool in p.states.values():
        pool[:, 1].normal_()
    p.copy_state(1, 3)
    assert all(torch.equal(pool[:, 3], pool[:, 1]) for pool in p.states.values())
    p.clear_state(1)
    assert all(not pool[:, 1].any() and pool[:, 3].any() for pool in p.states.values() if pool.numel())
    p.check_integrity()
    p.states["gdn_state"][1, 0, 0, 0, 0] = 1.0
    with pytest.raises(AssertionError, match="padding slot 0 of the gdn_state pool"):
        p.check_integrity()
