"""The worker's features over Mamba, FalconMamba and Jamba checkpoints built by transformers
(tests/fixtures/mamba1_model.py): a mixed step (fresh, resumed and one-token prefills, decodes, a non-final
chunk) gives each request's logits, conv windows and SSM states alone (bitwise in the deterministic mode);
quantized weights run the Mamba1 mixers' in_proj / x_proj / dt_proj / out_proj (and Jamba's attention,
SwiGLU and experts) against their dequantized reference; the state store round-trips a slot's conv windows
and SSM states (int8 values with their scales); a bfloat16 model tracks transformers' bfloat16 forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures.mamba1_model import MAMBA1_CONFIGS, mamba1_dir
from tests.worker.family_features import (
    check_mixed_batch_equals_each_alone,
    check_quantized_logits,
    check_state_store_round_trip,
    quantized_runner,
)
from tests.worker.test_parity_mamba1 import CONV, SSM
from tests.worker.util import runner_at
from worker_proc.loading.checkpoint import load_config
from worker_proc.model.mamba1 import Mamba1Mixer
from worker_proc.state.pools import StatePools

NAMES = tuple(MAMBA1_CONFIGS)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_mixed_batch_equals_each_alone(name: str, deterministic: bool) -> None:
    check_mixed_batch_equals_each_alone(mamba1_dir(name), deterministic, (CONV, SSM), kv=False)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("name", ["mamba_bias", "jamba"])
def test_quantized_products(name: str, fmt: str) -> None:
    r = quantized_runner(mamba1_dir(name), fmt)
    mixer = next(m for m in r.model.modules() if isinstance(m, Mamba1Mixer))
    assert all(getattr(mixer, n).gemm.quantized is not None for n in ("in_proj", "x_proj", "dt_proj", "out_proj"))
    check_quantized_logits(r, fmt)


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_state_store_round_trips_the_state(tmp_path: Path, state_dtype: str) -> None:
    """The state store writes a slot's conv windows and SSM states (int8: values and scales) with its KV and a
    load puts them back, bit for bit, into other slots."""
    p = StatePools(load_config(mamba1_dir("jamba")), kv_slots=40, state_slots=4, dtype=torch.float32, device="cpu",
                   state_dtype=state_dtype)
    names = {CONV, SSM} | ({SSM + "_scale"} if state_dtype == "int8" else set())
    assert {n for n, t in p.states.items() if t.numel()} == names
    check_state_store_round_trip(tmp_path, p, tuple(sorted(names)))


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_model_tracks_transformers_in_bfloat16(name: str) -> None:
    """A bfloat16 model's prompt logits against transformers' own bfloat16 forward of the same checkpoint. The
    tiny random checkpoints amplify bfloat16 rounding (transformers' bfloat16 logits differ from its float32 ones
    by up to 2.4 at a logit scale of 7), so the bound is wide: measured at most 0.44, where a wrong cast or a
    16-bit scan would give the float32 reference's whole drift."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from tests.model_driver import forward_all_logits
    from tests.worker.util import batch, req

    ref = load_file(f"{mamba1_dir(name)}/reference.safetensors")
    prompt = ref["prompt"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(mamba1_dir(name), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hf = hf_model(prompt[None], use_cache=False).logits[0].float()
    r = runner_at(mamba1_dir(name), kv_slots=100, dtype="bfloat16")
    step = batch(0, [req("a", prompt.tolist(), 0, list(range(1, len(prompt) + 1)), 1)], clears=[1])
    ours = forward_all_logits(r, step)["a"].float()
    assert r.pools.states[CONV].dtype == torch.bfloat16 and r.pools.states[SSM].dtype == torch.float32
    assert float((ours - hf).abs().max()) <= 0.6
