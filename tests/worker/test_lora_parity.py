"""LoRA adapters made by `peft` over the parity fixtures of every family (Granite 4.0-H dense and MoE,
Nemotron-H dense and MoE, Falcon-H1, Bamba, Mamba2, Qwen3-Next, Qwen3.5 dense and MoE) against
`PeftModel.from_pretrained` on the transformers model: every prompt row's logits and the decode steps'
within 1e-4 (fp32) and identical greedy tokens, through `ModelRunner` with the adapter sent in a real
(msgpack round-tripped) `LoraLoad`. Each family's adapter covers every kind of linear layer it has: attention
q/k/v/o, Mamba in/out_proj, Gated DeltaNet projections in Qwen3-Next's fused (in_proj_qkvz / in_proj_ba) and
Qwen3.5's split (in_proj_qkv / _z / _b / _a) forms, fused (Granite's input_linear / output_linear) and split
gated MLPs, relu2 MLPs, shared experts, Nemotron's latent projections; rsLoRA and a regex target_modules
included (PEFT itself refuses Mamba's out_proj for the falcon_h1, mamba2 and nemotron_h model types; Granite
and Bamba adapters cover it). Also: an int8-, int4- or fp8-quantized base with an adapter against the dequantized
model with the adapter."""

from __future__ import annotations

import pytest
import torch

from shared.messages import LoraLoad
from tests.worker.lora_util import adapter_of, hf_base, make_adapter, peft_reference, serve_one
from tests.worker.util import fixture_dir, max_diff, reference, runner
from worker_proc.linear.formats import LINEAR_METHODS
from worker_proc.plan.execution_plan import fixed_plan

TOL = 1e-4
STEPS = 6
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MAMBA = ["in_proj", "out_proj"]
SPLIT_MLP = ["gate_proj", "up_proj", "down_proj"]
CASES: dict[str, tuple[list[str] | str, dict]] = {
    "nope_groups2": ([*ATTN, *MAMBA, "input_linear", "output_linear"], {}),
    "rope_moe": (["q_proj", "v_proj", "out_proj", "input_linear", "output_linear"], dict(rslora=True, r=8, alpha=4.0)),
    "nemotron_h_dense": ([*ATTN, "in_proj", "up_proj", "down_proj"], {}),
    "nemotron_h_moe": (["in_proj", "o_proj", "up_proj", "down_proj", "fc1_latent_proj", "fc2_latent_proj"], {}),
    "falcon_h1": ([*ATTN, "in_proj", *SPLIT_MLP], dict(rslora=True)),
    "bamba": ([*ATTN, *MAMBA, *SPLIT_MLP], dict(r=2, alpha=5.0)),
    "mamba2": (["in_proj"], dict(r=6)),
    # no MLP names: PEFT turns gate_proj / up_proj / down_proj of this model type into target_parameters of the
    # routed experts (refused, test_lora_adapter.py)
    "qwen3_next_moe": (["in_proj_qkvz", "in_proj_ba", "out_proj", *ATTN, "shared_expert_gate"], {}),
    "qwen3_5_dense": (["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", *ATTN, *SPLIT_MLP], {}),
    "qwen3_5_moe": (r".*\.(in_proj_(qkv|z|b|a)|out_proj|q_proj|o_proj|shared_expert\.(gate|up|down)_proj)", {}),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(fixture_dir(name), str(root / name), targets, seed=i, **kw)
            for i, (name, (targets, kw)) in enumerate(CASES.items())}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_adapter_matches_peft(name: str, deterministic: bool, adapters: dict[str, str]) -> None:
    prompt = reference(name)["prompt"].tolist()
    ref_prompt, ref_tokens, ref_decode = peft_reference(fixture_dir(name), adapters[name], prompt, STEPS)
    assert max_diff(ref_prompt, reference(name)["prompt_logits"]) > 0.05  # the adapter changes the model
    adapter = adapter_of(name, adapters[name])
    targets = CASES[name][0]
    if not isinstance(targets, str):  # every target names layers of the model the adapter changes
        assert all(any(t.endswith("." + x) for t in adapter.targets) for x in targets), adapter.targets
    r = runner(name, kv_slots=256, max_loras=2, deterministic=deterministic)
    logits, tokens, decode = serve_one(r, prompt, STEPS, 2, [LoraLoad(slot=2, adapter=adapter)])
    assert max_diff(logits, ref_prompt) <= TOL
    assert tokens == ref_tokens
    assert max(max_diff(a, b) for a, b in zip(decode, ref_decode, strict=True)) <= TOL
    r.check_integrity()


def _dequantized_reference(r: object, model_dir: str) -> torch.nn.Module:
    """The transformers model with every linear layer the runner holds quantized set to its dequantized weight."""
    import re

    hf = hf_base(model_dir)
    ours = dict(r.model.named_modules())  # type: ignore[attr-defined]
    swapped = 0
    for name, module in hf.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        mapped = name + ".weight"
        for pattern, repl in r.model.cfg.renames:  # type: ignore[attr-defined]
            mapped = re.sub(pattern, repl, mapped)
        site = getattr(ours.get(mapped.removesuffix(".weight")), "gemm", None)
        if site is not None and site.quantized is not None:
            with torch.no_grad():
                module.weight.copy_(site.quantized.dequantize(torch.float32))
            swapped += 1
    assert swapped
    return hf


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("name", ["falcon_h1", "qwen3_5_dense"])
def test_adapter_over_a_quantized_base_matches_the_dequantized_model(name: str, quantization: str,
                                                                     adapters: dict[str, str]) -> None:  # fmt: skip
    """The base products run on the format's reference (the dequantized weight): the LoRA term is added to the
    quantized layer's product in float, as PEFT adds it to the dequantized model's."""
    from peft import PeftModel

    r = runner(name, kv_slots=256, max_loras=1, quantization=quantization, quantize_lm_head=False,
               deterministic=True)  # fmt: skip
    r.bind_plan(fixed_plan(r.model, {s: m.reference for s, m in LINEAR_METHODS.items()}))
    assert all(layer_site.quantized is not None for layer_site in
               (m.gemm for n, m in r.model.named_modules() if n.endswith(("q_proj", "down_proj"))))
    prompt = reference(name)["prompt"].tolist()
    model = PeftModel.from_pretrained(_dequantized_reference(r, fixture_dir(name)), adapters[name]).eval()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].float()
    logits, _, _ = serve_one(r, prompt, 1, 1, [LoraLoad(slot=1, adapter=adapter_of(name, adapters[name]))])
    assert max_diff(logits, ref) <= TOL
