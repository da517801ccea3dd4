"""Worker feature checks over a family checkpoint (tests/fixtures/family_checkpoint.py): a mixed step
(test_batch_invariance's fresh, resumed and one-token prefills, decodes and a non-final chunk) against
each request alone; quantized weights against their dequantized reference (test_quantized_models);
the state store (test_state_tier's keys, block and namespace) writing a slot's KV and state pools and
loading them back into other slots.

The family's test passes the names of its state pools (`StatePools.states`) and asserts what is its
own (which modules are quantized, which pools exist) itself."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.messages import ForwardBatch, StoreLoad, StoreWrite
from shared.state_store import DirectoryStore
from tests.worker.test_batch_invariance import close, mixed_and_alone
from tests.worker.test_quantized_models import FIXTURE_MIN_COSINE, _plan_and_reference
from tests.worker.test_state_tier import BLOCK, KEYS, NAMESPACE, STATE_KEY, settle_all
from tests.worker.util import runner_at
from worker_proc.runtime.runner import ModelRunner
from worker_proc.state.pools import StatePools
from worker_proc.state.store_tier import EntryLayout, StoreTier

QUANTIZED_PROMPT = list(range(5, 40))


def check_mixed_batch_equals_each_alone(model_dir: str, deterministic: bool, pools: tuple[str, ...],
                                        kv: bool) -> None:
    """One step of six requests together gives each request's logits, and leaves each of `pools` (and, with
    `kv`, the K pool) as the requests run one by one do: within test_batch_invariance's `close`, bitwise
    in the deterministic mode."""
    alone = runner_at(model_dir, deterministic=deterministic)
    together = runner_at(model_dir, deterministic=deterministic)
    got, expected = mixed_and_alone(alone, together)
    assert set(got) == set(expected) == {"a", "b", "c", "d", "e", "f"}
    for rid in expected:
        assert close(got[rid], expected[rid], deterministic), rid
    for pool in pools:
        assert close(together.pools.states[pool], alone.pools.states[pool], deterministic), pool
    if kv:
        assert close(together.pools.k, alone.pools.k, deterministic)
    together.check_integrity()


def quantized_runner(model_dir: str, fmt: str) -> ModelRunner:
    """A runner of the checkpoint with its weights quantized to `fmt`, sized for QUANTIZED_PROMPT."""
    return runner_at(model_dir, kv_slots=len(QUANTIZED_PROMPT) + 8, quantization=fmt)


def check_quantized_logits(r: ModelRunner, fmt: str, bound: float = FIXTURE_MIN_COSINE, mean: bool = False) -> None:
    """QUANTIZED_PROMPT through `r` (a `quantized_runner`) gives finite logits whose rows point as the
    dequantized reference's do: the least cosine of a row (with `mean`, the mean over the rows) is at
    least `bound`; every quantizable product holds its quantized weight (test_quantized_models)."""
    got, want = _plan_and_reference(r, QUANTIZED_PROMPT, fmt)
    assert bool(torch.isfinite(got).all())
    rows = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    cosine = float(rows.mean() if mean else rows.min())
    assert cosine >= bound, f"logit rows {cosine:.3f} apart"


def check_state_store_round_trip(tmp_path: Path, p: StatePools, pools: tuple[str, ...]) -> EntryLayout:
    """Fill `p` at random (int8 pools with int8 values; the padding slot 0 zero), write KV slots 1..12 and
    state slot 2 to a directory store under `tmp_path`, load them into KV slots 20..31 and state slot 3:
    K, V and each of `pools` come back bit for bit (and are not all zero). Returns the tier's entry layout."""
    gen = torch.Generator().manual_seed(0)
    for t in (p.k, p.v, *p.states.values()):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype) if t.dtype != torch.int8
                else torch.randint(-127, 128, t.shape, generator=gen, dtype=torch.int8))  # fmt: skip
        t[:, 0].zero_()  # padding slot
    tier = StoreTier(DirectoryStore(tmp_path, 1 << 30, NAMESPACE), p, BLOCK, 1 << 30)
    src = list(range(1, 13))
    tier.serve(ForwardBatch(step=1, reqs=[], store_writes=[StoreWrite(kv_keys=KEYS[:3], kv_slots=src,
                                                                       state_key=STATE_KEY, state_slot=2)]))
    assert tier.writer.flush(30)
    dst = list(range(20, 32))
    tier.serve(ForwardBatch(step=2, reqs=[], store_loads=[StoreLoad(load_id=1, kv_keys=KEYS[:3], skip=0,
                                                                    kv_slots=dst, state_key=STATE_KEY, state_slot=3)]))
    assert settle_all(tier) == ([1], [])
    assert torch.equal(p.k[:, dst], p.k[:, src]) and torch.equal(p.v[:, dst], p.v[:, src])
    for n in pools:
        assert torch.equal(p.states[n][:, 3], p.states[n][:, 2]) and p.states[n][:, 3].any(), n
    tier.close(5)
    return tier.layout
