"""Kimi Linear under the Triton kernel set (interpreted on CPU, tests/kernels/conftest.py): the KDA convs on
the Triton conv kernels, MLA's cached latent (one KV head) on the Triton attention kernels, the delta rule on the
pure-torch backend the set holds where flash-linear-attention is absent; all-position prompt logits and
per-step decode logits within 1e-4 of transformers' (checkpoints built at test time,
tests/fixtures/kimi_linear_model.py)."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file

from tests.fixtures.kimi_linear_model import KIMI_CONFIGS, kimi_dir
from tests.model_driver import forward_all_logits
from tests.worker.util import batch, decode_logit_diffs, max_diff, req, runner_at

TOL = 1e-4


@pytest.mark.parametrize("name", tuple(KIMI_CONFIGS))
def test_triton_set_matches_transformers(name: str) -> None:
    ref = load_file(os.path.join(kimi_dir(name), "reference.safetensors"))
    prompt, gen = ref["prompt"].tolist(), ref["gen_tokens"].tolist()[:3]
    r = runner_at(kimi_dir(name), kv_slots=100, kernels="triton")
    assert type(r.ops).__name__ == "TritonOps" and r.ops.kda.name == "reference"
    out = forward_all_logits(r, batch(0, [req("a", prompt, 0, list(range(1, len(prompt) + 1)), 1)], clears=[1]))
    assert max_diff(out["a"], ref["prompt_logits"]) <= TOL
    diffs = decode_logit_diffs(runner_at(kimi_dir(name), kv_slots=100, kernels="triton"), prompt, gen,
                               ref["gen_logits"][: len(gen)])  # fmt: skip
    assert max(diffs) <= TOL, diffs
