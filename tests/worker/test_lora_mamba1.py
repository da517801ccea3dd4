"""LoRA adapters made by `peft` over Mamba and Jamba checkpoints built by transformers
(tests/fixtures/mamba1_model.py) against `PeftModel.from_pretrained`: every prompt row's logits and the decode
steps' within 1e-4 (fp32) and identical greedy tokens, through `ModelRunner` with the adapter sent in a real
`LoraLoad`. The adapters cover the Mamba1 mixers' in_proj / out_proj and, in Jamba, attention q/k/v/o and the
dense SwiGLU's gate / up / down (x_proj, dt_proj and the experts take none; peft itself refuses out_proj on a
Mamba / FalconMamba model, so there the adapter covers in_proj alone)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from shared.messages import LoraLoad
from tests.fixtures.mamba1_model import mamba1_dir
from tests.worker.lora_util import adapter_of, make_adapter, peft_reference, serve_one
from tests.worker.util import max_diff, runner_at

TOL = 1e-4
STEPS = 6
# peft refuses out_proj on model_type "mamba" / "falcon_mamba" (its fused-kernel rule), not on Jamba
TARGETS = {"mamba_bias": ["in_proj"],
           "jamba": ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"]}  # fmt: skip


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", tuple(TARGETS))
def test_adapter_matches_peft(name: str, deterministic: bool, tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("peft")
    model_dir = mamba1_dir(name)
    adapter_dir = make_adapter(model_dir, str(tmp_path_factory.mktemp(f"lora_{name}")), TARGETS[name], seed=3)
    reference = load_file(f"{model_dir}/reference.safetensors")
    prompt = reference["prompt"].tolist()
    ref_prompt, ref_tokens, ref_decode = peft_reference(model_dir, adapter_dir, prompt, STEPS)
    assert max_diff(ref_prompt, reference["prompt_logits"]) > 0.05  # the adapter changes the model
    adapter = adapter_of(name, adapter_dir, model_dir=model_dir)
    served = {t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1] for t in adapter.targets}
    mixer = "mixer" if name == "mamba_bias" else "mamba"
    assert f"{mixer}.in_proj" in served and (name == "mamba_bias" or "mamba.out_proj" in served), served
    r = runner_at(model_dir, kv_slots=256, max_loras=2, deterministic=deterministic)
    logits, tokens, decode = serve_one(r, prompt, STEPS, 2, [LoraLoad(slot=2, adapter=adapter)])
    assert max_diff(logits, ref_prompt) <= TOL
    assert tokens == ref_tokens
    assert max(max_diff(a, b) for a, b in zip(decode, ref_decode, strict=True)) <= TOL
    r.check_integrity()
