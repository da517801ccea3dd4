"""A bfloat16 Mamba / FalconMamba with `residual_in_fp32` (transformers' default, the fixtures' configs) carries
its residual stream as transformers' blocks do: the sum of every mixer output in float32, each block's norm
reading it rounded to bfloat16, the final norm reading it whole.

The comparison runs transformers' own model code (blocks, norms, final norm, LM head) with each block's mixer
replaced by the output hyssm's mixer gave for that layer: transformers' CPU mixers round their scan state and
dt to bfloat16 where hyssm keeps float32 (0.1 to 0.2 apart in logits of magnitude 6 on these checkpoints,
tests/worker/test_mamba1_features.py), which would hide the residual's own rounding (a few hundredths). What is
left to differ is the stream between the mixers: every mixer's input must be the one transformers computes,
and the logits transformers'."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.fixtures.mamba1_model import mamba1_dir
from tests.model_driver import forward_all_logits
from tests.worker.util import batch, req, runner_at
from worker_proc.model.mamba1 import Mamba1Mixer

LOGIT_TOL = 0.008
"""Max abs difference of the prompt logits (magnitude ~6, from a bfloat16 LM head: one unit in the last place is
1/32 above 4). Measured 0 on both checkpoints (the same roundings in the same order); the stream rounded to
bfloat16 after every sum (the residual kept in the model dtype) gives 0.031 on both."""
INPUT_TOL = 0.008
"""Max abs difference of a mixer's normed bfloat16 input (magnitude ~5). Measured 0; the residual kept in the model
dtype gives 0.031 at the third layer (the first two read the same sums either way)."""


class ReplayedMixer(nn.Module):
    """A transformers block's mixer that returns hyssm's output for its layer and keeps the input it was given."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output
        self.seen: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, **kwargs: object) -> torch.Tensor:
        self.seen = hidden_states[0].clone()
        return self.output[None]


def _hyssm_prompt(name: str, prompt: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """hyssm's bfloat16 prompt logits and each Mamba1 layer's mixer (input, output) of that forward."""
    r = runner_at(mamba1_dir(name), kv_slots=100, dtype="bfloat16")
    mixers = [m for m in r.model.modules() if isinstance(m, Mamba1Mixer)]
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(i: int):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            seen[i] = (args[0].clone(), out.clone())

        return hook

    handles = [m.register_forward_hook(keep(i)) for i, m in enumerate(mixers)]
    try:
        step = batch(0, [req("a", prompt, 0, list(range(1, len(prompt) + 1)), 1)], clears=[1])
        logits = forward_all_logits(r, step)["a"].float()
    finally:
        for h in handles:
            h.remove()
    return logits, [seen[i] for i in range(len(mixers))]


@pytest.mark.parametrize("name", ["mamba_bias", "falcon_mamba"])
def test_bfloat16_residual_stream_is_transformers_float32_one(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    with open(os.path.join(mamba1_dir(name), "config.json")) as f:
        assert json.load(f).get("residual_in_fp32", True)
    prompt = load_file(os.path.join(mamba1_dir(name), "reference.safetensors"))["prompt"]
    ours, layers = _hyssm_prompt(name, prompt.tolist())
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(mamba1_dir(name), dtype=torch.bfloat16).eval()
    blocks = hf_model.backbone.layers
    assert len(blocks) == len(layers) and all(b.residual_in_fp32 for b in blocks)
    replays = [ReplayedMixer(out) for _, out in layers]
    for block, replay in zip(blocks, replays, strict=True):
        block.mixer = replay
    with torch.inference_mode():
        hf = hf_model(prompt[None], use_cache=False).logits[0].float()
    for i, ((mine, _), replay) in enumerate(zip(layers, replays, strict=True)):
        assert replay.seen is not None and replay.seen.dtype == mine.dtype == torch.bfloat16
        assert float((replay.seen.float() - mine.float()).abs().max()) <= INPUT_TOL, i
    assert float((ours - hf).abs().max()) <= LOGIT_TOL
    assert torch.equal(ours.argmax(-1), hf.argmax(-1))  # the greedy token after every prompt position


def test_the_family_reads_residual_in_fp32() -> None:
    """`residual_in_fp32` absent is transformers' default (true); Jamba has no such option."""
    from shared.families.registry import parse_config
    from shared.model_info import read_config_json

    raw = read_config_json(mamba1_dir("mamba_bias"))
    raw.pop("residual_in_fp32", None)
    assert parse_config(raw).residual_fp32
    assert not parse_config(dict(raw, residual_in_fp32=False)).residual_fp32
    assert not parse_config(read_config_json(mamba1_dir("jamba"))).residual_fp32
