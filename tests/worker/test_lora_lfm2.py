"""LoRA adapters made by `peft` over LFM2 checkpoints built by transformers (tests/fixtures/lfm2_model.py)
against `PeftModel.from_pretrained`: every prompt row's logits and the decode steps' within 1e-4 (fp32) and
identical greedy tokens, through `ModelRunner` with the adapter sent in a real `LoraLoad`. The adapter covers
every linear layer of the family: the short convolutions' in_proj / out_proj, attention q/k/v and its
`out_proj` (served as o_proj), the SwiGLU's w1 / w3 / w2 (served as gate / up / down)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from shared.messages import LoraLoad
from tests.fixtures.lfm2_model import lfm2_dir
from tests.worker.lora_util import adapter_of, make_adapter, peft_reference, serve_one
from tests.worker.util import max_diff, runner_at

TOL = 1e-4
STEPS = 6
TARGETS = ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "w1", "w2", "w3"]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", ["lfm2_bias", "lfm2_k4"])
def test_adapter_matches_peft(name: str, deterministic: bool, tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("peft")
    model_dir = lfm2_dir(name)
    adapter_dir = make_adapter(model_dir, str(tmp_path_factory.mktemp(f"lora_{name}")), TARGETS, seed=3)
    reference = load_file(f"{model_dir}/reference.safetensors")
    prompt = reference["prompt"].tolist()
    ref_prompt, ref_tokens, ref_decode = peft_reference(model_dir, adapter_dir, prompt, STEPS)
    assert max_diff(ref_prompt, reference["prompt_logits"]) > 0.05  # the adapter changes the model
    adapter = adapter_of(name, adapter_dir, model_dir=model_dir)
    served = {t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1] for t in adapter.targets}
    assert {"conv.in_proj", "conv.out_proj", "self_attn.o_proj", "feed_forward.gate_proj"} <= served, served
    r = runner_at(model_dir, kv_slots=256, max_loras=2, deterministic=deterministic)
    logits, tokens, decode = serve_one(r, prompt, STEPS, 2, [LoraLoad(slot=2, adapter=adapter)])
    assert max_diff(logits, ref_prompt) <= TOL
    assert tokens == ref_tokens
    assert max(max_diff(a, b) for a, b in zip(decode, ref_decode, strict=True)) <= TOL
    r.check_integrity()
