"""What the LoRA tests share: adapters made by `peft` itself over the parity fixtures' checkpoints (every
lora_B randomised: PEFT starts it at zero), their reference logits from `PeftModel.from_pretrained`, and the
batches that load an adapter into a slot and run slices under it."""

from __future__ import annotations

import os

import torch

from shared.lora import read_adapter
from shared.messages import ForwardBatch, LoraLoad, ReqSlice
from shared.messages.lora import LoraAdapter
from tests.model_driver import forward_all_logits, forward_logits
from tests.worker.util import GREEDY, fixture_dir, wire
from worker_proc.loading.checkpoint import load_config
from worker_proc.runtime.runner import ModelRunner


def hf_base(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(model_dir: str, out_dir: str, targets: list[str] | str, r: int = 4, alpha: float = 8.0,
                 seed: int = 0, rslora: bool = False, **extra: object) -> str:
    """A PEFT LoRA adapter of the checkpoint in `model_dir` saved to `out_dir`, A and B drawn from `seed`."""
    from peft import LoraConfig, get_peft_model

    options: dict = {"lora_dropout": 0.05, **extra}
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, **options)
    model = get_peft_model(hf_base(model_dir), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 / p.shape[-1] ** 0.5))
    model.save_pretrained(out_dir)
    return out_dir


def peft_reference(model_dir: str, adapter_dir: str | None, prompt: list[int],
                   steps: int) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:  # fmt: skip
    """(logits of every prompt row [L, V], `steps` greedy tokens, the logits each token after the first was
    chosen from) of the base model under the adapter (PeftModel.from_pretrained; None: the base alone), each
    token by a full forward pass without cache."""
    from peft import PeftModel

    model = hf_base(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = list(prompt)
    with torch.no_grad():
        prompt_logits = model(torch.tensor([ids])).logits[0].float()
        tokens, decode = [int(prompt_logits[-1].argmax())], []
        for _ in range(steps - 1):
            ids.append(tokens[-1])
            decode.append(model(torch.tensor([ids])).logits[0, -1].float())
            tokens.append(int(decode[-1].argmax()))
    return prompt_logits, tokens, decode


def adapter_of(name: str, adapter_dir: str, max_rank: int = 64, model_dir: str = "") -> LoraAdapter:
    return read_adapter(os.path.basename(adapter_dir), adapter_dir, load_config(model_dir or fixture_dir(name)),
                        max_rank)


def lora_batch(step: int, reqs: list[ReqSlice], loads: list[LoraLoad] | None = None,
               clears: list[int] | None = None) -> ForwardBatch:
    return wire(ForwardBatch(step=step, reqs=reqs, clears=clears or [], lora_loads=loads or []))


def serve_one(r: ModelRunner, prompt: list[int], steps: int, slot: int, loads: list[LoraLoad] | None = None,
              state_slot: int = 1, first_step: int = 0) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """One request alone under adapter slot `slot` (`loads` sent with its prompt): (every prompt row's
    logits, `steps` greedy tokens, the logits each token after the first was chosen from)."""
    n = len(prompt)
    kv = list(range(1, n + steps + 1))
    sl = ReqSlice(rid="a", input_ids=list(prompt), start_pos=0, kv_slots=kv[:n], state_slot=state_slot, sample=True,
                  sampling=GREEDY, lora_slot=slot)
    prompt_logits = forward_all_logits(r, lora_batch(first_step, [sl], loads, clears=[state_slot]))["a"]
    tokens, decode = [int(prompt_logits[-1].argmax())], []
    for i in range(1, steps):
        pos = n + i - 1
        sl = ReqSlice(rid="a", input_ids=[tokens[-1]], start_pos=pos, kv_slots=kv[: pos + 1], state_slot=state_slot,
                      sample=True, sampling=GREEDY, output_len=i, lora_slot=slot)
        decode.append(forward_logits(r, lora_batch(first_step + i, [sl]))["a"])
        tokens.append(int(decode[-1].argmax()))
    return prompt_logits, tokens, decode
