"""The worker's features over LFM2 and LFM2-MoE checkpoints built by transformers
(tests/fixtures/lfm2_model.py): a mixed step (fresh, resumed and one-token prefills, decodes, a
non-final chunk) gives each request's logits and conv windows alone (bitwise in the deterministic
mode, the multi-segment prefill conv batched by the default kernels); quantized weights run every
product of the model (the conv's in_proj / out_proj, attention, SwiGLU and experts) against their
dequantized reference; `--mamba-ssm-dtype` changes nothing, as a short conv's state is its conv window
alone (model dtype); the state store round-trips a slot's conv windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.messages import ForwardBatch, StoreLoad, StoreWrite
from shared.state_store import DirectoryStore
from tests.fixtures.lfm2_model import LFM2_CONFIGS, lfm2_dir
from tests.model_driver import forward_all_logits
from tests.worker.test_batch_invariance import close, mixed_and_alone
from tests.worker.test_parity_lfm2 import WINDOW
from tests.worker.test_quantized_models import FIXTURE_MIN_COSINE, _plan_and_reference
from tests.worker.test_state_tier import BLOCK, KEYS, NAMESPACE, STATE_KEY, settle_all
from tests.worker.util import batch, req, runner_at
from worker_proc.loading.checkpoint import load_config
from worker_proc.model.short_conv import ShortConv
from worker_proc.state.pools import StatePools
from worker_proc.state.store_tier import StoreTier

NAMES = tuple(LFM2_CONFIGS)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_mixed_batch_equals_each_alone(name: str, deterministic: bool) -> None:
    alone = runner_at(lfm2_dir(name), deterministic=deterministic)
    together = runner_at(lfm2_dir(name), deterministic=deterministic)
    got, expected = mixed_and_alone(alone, together)
    assert set(got) == set(expected) == {"a", "b", "c", "d", "e", "f"}
    for rid in expected:
        assert close(got[rid], expected[rid], deterministic), rid
    assert close(together.pools.states[WINDOW], alone.pools.states[WINDOW], deterministic)
    assert close(together.pools.k, alone.pools.k, deterministic)
    together.check_integrity()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("name", NAMES)
def test_quantized_products(name: str, fmt: str) -> None:
    prompt = list(range(5, 40))
    r = runner_at(lfm2_dir(name), kv_slots=len(prompt) + 8, quantization=fmt)
    conv = next(m for m in r.model.modules() if isinstance(m, ShortConv))
    assert conv.in_proj.gemm.quantized is not None and conv.out_proj.gemm.quantized is not None
    got, want = _plan_and_reference(r, prompt, fmt)
    assert bool(torch.isfinite(got).all())
    cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=-1).min())
    assert cosine >= FIXTURE_MIN_COSINE, f"logit rows {cosine:.3f} apart"


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_state_dtype_leaves_the_conv_window_alone(state_dtype: str) -> None:
    name = "lfm2_bias"
    prompt = list(range(7, 30))
    kv = list(range(1, len(prompt) + 1))
    step = batch(0, [req("a", prompt, 0, kv, 1)], clears=[1])
    plain = runner_at(lfm2_dir(name), deterministic=True)
    other = runner_at(lfm2_dir(name), deterministic=True, state_dtype=state_dtype)
    assert torch.equal(forward_all_logits(plain, step)["a"], forward_all_logits(other, step)["a"])
    for r in (plain, other):  # the slot holds the conv windows only, in the model dtype
        assert {n for n, t in r.pools.states.items() if t.numel()} == {WINDOW}
    assert other.pools.states[WINDOW].dtype == torch.float32
    assert torch.equal(plain.pools.states[WINDOW], other.pools.states[WINDOW])


def test_state_store_round_trips_the_conv_windows(tmp_path: Path) -> None:
    """The state store writes a slot's conv windows (the whole LFM2 state) with its KV and a load puts both
    back, bit for bit, into other slots."""
    p = StatePools(load_config(lfm2_dir("lfm2_bias")), kv_slots=40, state_slots=4, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    for t in (p.k, p.v, *p.states.values()):
        t.copy_(torch.randn(t.shape, generator=gen))
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
    assert torch.equal(p.states[WINDOW][:, 3], p.states[WINDOW][:, 2]) and p.states[WINDOW][:, 3].any()
    tier.close(5)
