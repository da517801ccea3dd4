"""A Qwen3-Next fixture with one MTP layer, written the way the released checkpoints store it
(`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`, `mtp.layers.0.*` with
per-expert tensors; `mtp_num_hidden_layers` in config.json), and a reference MTP built from
transformers' own Qwen3-Next decoder layer and norm (transformers skips `mtp.*` when it loads a model,
so the reference composes them as the released MTP layers are documented to run)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "qwen3_next_moe")
TEMPLATE_LAYER = 1  # a full-attention layer of the fixture: its tensors, perturbed, are the MTP layer's


def write_mtp_checkpoint(dst: str, seed: int = 0) -> str:
    """Copy the qwen3_next_moe fixture into `dst` and give it one MTP layer; returns `dst`."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(SOURCE):
        if name != "model.safetensors":
            shutil.copy(os.path.join(SOURCE, name), dst)
    tensors = load_file(os.path.join(SOURCE, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{TEMPLATE_LAYER}."
    for name, t in list(tensors.items()):
        if name.startswith(prefix):
            noise = 1.0 + 0.3 * torch.randn(t.shape, generator=g)
            tensors["mtp.layers.0." + name[len(prefix):]] = (t * noise).contiguous()
    hidden = tensors["model.norm.weight"].shape[0]
    tensors["mtp.fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=g)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.1 * torch.randn(hidden, generator=g)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["mtp_num_hidden_layers"] = 1
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


class ReferenceMtp:
    """transformers' Qwen3-Next with the checkpoint's MTP layer beside it, over whole sequences."""

    def __init__(self, model_dir: str) -> None:
        from transformers import Qwen3NextForCausalLM
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

        self.hf = Qwen3NextForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        cfg = self.hf.config
        tensors = load_file(os.path.join(model_dir, "model.safetensors"))
        self.layer = self._mtp_layer(model_dir, tensors)
        self.fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.fc.weight.data.copy_(tensors["mtp.fc.weight"])
        self.norms = {}
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[norm] = Qwen3NextRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.norms[norm].weight.data.copy_(tensors[f"mtp.{norm}.weight"])

    @staticmethod
    def _mtp_layer(model_dir: str, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        """transformers' decoder layer holding the MTP layer's tensors, converted by transformers' own
        loading: a copy of the checkpoint whose template layer holds them."""
        from transformers import Qwen3NextForCausalLM

        swapped = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
        swapped.update({f"model.layers.{TEMPLATE_LAYER}." + k[len("mtp.layers.0."):]: v
                        for k, v in tensors.items() if k.startswith("mtp.layers.0.")})  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(os.path.join(model_dir, "config.json"), tmp)
            save_file(swapped, os.path.join(tmp, "model.safetensors"))
            holder = Qwen3NextForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        return holder.model.layers[TEMPLATE_LAYER]

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        """The MTP layer over inputs x [1, T, H] at positions 0..T-1 (causal), then its norm."""
        pos = torch.arange(x.shape[1])[None]
        rope = self.hf.model.rotary_emb(x, pos)
        return self.norms["norm"](self.layer(x, position_embeddings=rope, attention_mask=None, position_ids=pos))

    def _input(self, token: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = self.hf.model.embed_tokens(token)
        return self.fc(torch.cat([self.norms["pre_fc_norm_embedding"](e), self.norms["pre_fc_norm_hidden"](hidden)],
                                 dim=-1))  # fmt: skip

    @torch.no_grad()
    def guesses(self, tokens: list[int], k: int) -> list[int]:
        """The `k` greedy MTP guesses after `tokens` (the last one just sampled): position i of the
        MTP takes token i + 1 and the model's hidden state at i; each further guess feeds the last one
        back with the MTP's own output."""
        ids = torch.tensor([tokens])
        hidden = self.hf.model(input_ids=ids[:, :-1]).last_hidden_state
        x = self._input(ids[:, 1:], hidden)
        out: list[int] = []
        for _ in range(k):
            y = self._layer(x)[:, -1:]
            guess = self.hf.lm_head(y).argmax(dim=-1)
            out.append(int(guess))
            x = torch.cat([x, self._input(guess, y)], dim=1)
        return out
