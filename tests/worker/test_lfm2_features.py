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

from tests.fixtures.lfm2_model import LFM2_CONFIGS, lfm2_dir
from tests.model_driver import forward_all_logits
from tests.worker.family_features import (
    check_mixed_batch_equals_each_alone,
    check_quantized_logits,
    check_state_store_round_trip,
    quantized_runner,
)
from tests.worker.test_parity_lfm2 import WINDOW
from tests.worker.util import batch, req, runner_at
from worker_proc.loading.checkpoint import load_config
from worker_proc.model.short_conv import ShortConv
from worker_proc.state.pools import StatePools

NAMES = tuple(LFM2_CONFIGS)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_mixed_batch_equals_each_alone(name: str, deterministic: bool) -> None:
    check_mixed_batch_equals_each_alone(lfm2_dir(name), deterministic, (WINDOW,), kv=True)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("name", NAMES)
def test_quantized_products(name: str, fmt: str) -> None:
    r = quantized_runner(lfm2_dir(name), fmt)
    conv = next(m for m in r.model.modules() if isinstance(m, ShortConv))
    assert conv.in_proj.gemm.quantized is not None and conv.out_proj.gemm.quantized is not None
    check_quantized_logits(r, fmt)


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
    check_state_store_round_trip(tmp_path, p, (WINDOW,))
