"""Fixtures with MTP layers, written the way the released checkpoints store them, and reference MTPs
composed from transformers' own decoder layers and norms (transformers skips `mtp.*` when it loads a
model, so the references compose them as the released MTP layers are documented to run):
- Qwen3-Next: `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`,
  `mtp.layers.0.*` with per-expert tensors; `mtp_num_hidden_layers` in config.json.
- Nemotron-H: one MTP step of `mtp_layers_block_type` = (attention, moe) as `mtp.layers.0` (with
  `enorm`, `hnorm`, `eh_proj`) and `mtp.layers.1` (with `final_layernorm`), each `norm` + `mixer`;
  `num_nextn_predict_layers` in config.json."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
SOURCE = os.path.join(FIXTURES, "qwen3_next_moe")
NEMOTRON_SOURCE = os.path.join(FIXTURES, "nemotron_h_moe")
NEMOTRON_TEMPLATES = (2, 1)  # the fixture's attention and MoE layers: the MTP step's layers, perturbed
TEMPLATE_LAYER = 1  # a full-attention layer of the fixture: its tensors, perturbed, are the MTP layer's


def _copy_fixture(src: str, dst: str) -> dict[str, torch.Tensor]:
    """Everything but the weights copied from `src` into `dst`; returns the weights."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name not in ("model.safetensors", "reference.safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    return load_file(os.path.join(src, "model.safetensors"))


def _perturbed_copy(tensors: dict[str, torch.Tensor], src: str, dst: str, g: torch.Generator) -> None:
    """Tensors under prefix `src` copied, each value scaled by 1 + 0.3 N(0, 1), under prefix `dst`."""
    for name, t in list(tensors.items()):
        if name.startswith(src):
            noise = 1.0 + 0.3 * torch.randn(t.shape, generator=g)
            tensors[dst + name[len(src) :]] = (t * noise).contiguous()


def _save(tensors: dict[str, torch.Tensor], dst: str, **config: object) -> str:
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(config)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def write_mtp_checkpoint(dst: str, seed: int = 0) -> str:
    """Copy the qwen3_next_moe fixture into `dst` and give it one MTP layer; returns `dst`."""
    tensors = _copy_fixture(SOURCE, dst)
    g = torch.Generator().manual_seed(seed)
    _perturbed_copy(tensors, f"model.layers.{TEMPLATE_LAYER}.", "mtp.layers.0.", g)
    hidden = tensors["model.norm.weight"].shape[0]
    tensors["mtp.fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=g)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.1 * torch.randn(hidden, generator=g)
    return _save(tensors, dst, mtp_num_hidden_layers=1)


def write_nemotron_mtp_checkpoint(dst: str, seed: int = 0, steps: int = 1) -> str:
    """Copy the nemotron_h_moe fixture into `dst` and give it `steps` MTP steps (attention, MoE);
    returns `dst`."""
    tensors = _copy_fixture(NEMOTRON_SOURCE, dst)
    g = torch.Generator().manual_seed(seed)
    hidden = tensors["backbone.norm_f.weight"].shape[0]
    for step in range(steps):
        first, last = 2 * step, 2 * step + 1
        for i, template in zip((first, last), NEMOTRON_TEMPLATES, strict=True):
            _perturbed_copy(tensors, f"backbone.layers.{template}.", f"mtp.layers.{i}.", g)
        tensors[f"mtp.layers.{first}.eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=g)
        for norm in (f"{first}.enorm", f"{first}.hnorm", f"{last}.final_layernorm"):
            tensors[f"mtp.layers.{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    return _save(tensors, dst, num_nextn_predict_layers=steps)


def _converted(model_class: type, model_dir: str, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' `model_class` with `model_dir`'s config, loaded (converted by transformers' own
    loading) from `tensors`."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(model_dir, "config.json"), tmp)
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
        return model_class.from_pretrained(tmp, dtype=torch.float32).eval()


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    out = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    out.weight.data.copy_(weight)
    return out


def _norm(norm_class: type, weight: torch.Tensor, eps: float) -> torch.nn.Module:
    out = norm_class(weight.shape[0], eps=eps)
    out.weight.data.copy_(weight)
    return out


class _Reference:
    """A transformers model `hf` and its MTP beside it: subclasses give `_input` (the MTP's input at
    each position from the next token and the model's hidden state) and `_layer` (the MTP over
    inputs [1, T, H] at positions 0..T-1, causal, final norm included)."""

    hf: torch.nn.Module

    def _input(self, token: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

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


class ReferenceNemotronMtp(_Reference):
    """transformers' Nemotron-H with the checkpoint's first MTP step beside it: its two layers are
    transformers' own blocks (converted by transformers' loading from a copy of the checkpoint whose
    template layers hold them)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import NemotronHForCausalLM
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm

        self.hf = NemotronHForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        cfg = self.hf.config
        tensors = load_file(os.path.join(model_dir, "model.safetensors"))
        swapped = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
        for i, template in enumerate(NEMOTRON_TEMPLATES):
            for part in ("norm", "mixer"):
                src, dst = f"mtp.layers.{i}.{part}.", f"backbone.layers.{template}.{part}."
                swapped.update({dst + k[len(src) :]: v for k, v in tensors.items() if k.startswith(src)})
        holder = _converted(NemotronHForCausalLM, model_dir, swapped)
        self.blocks = [holder.model.layers[t] for t in NEMOTRON_TEMPLATES]
        self.eh_proj = _linear(tensors["mtp.layers.0.eh_proj.weight"])
        self.norms = {n: _norm(NemotronHRMSNorm, tensors[f"mtp.layers.{n}.weight"], cfg.layer_norm_epsilon)
                      for n in ("0.enorm", "0.hnorm", "1.final_layernorm")}  # fmt: skip

    def _input(self, token: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = self.hf.model.embeddings(token)
        return self.eh_proj(torch.cat([self.norms["0.enorm"](e), self.norms["0.hnorm"](hidden)], dim=-1))

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        for block in self.blocks:
            x = block(x, attention_mask=causal, position_ids=torch.arange(n)[None])
        return self.norms["1.final_layernorm"](x)


class ReferenceMtp(_Reference):
    """transformers' Qwen3-Next with the checkpoint's MTP layer beside it, over whole sequences."""

    def __init__(self, model_dir: str) -> None:
        from transformers import Qwen3NextForCausalLM
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

        self.hf = Qwen3NextForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        cfg = self.hf.config
        tensors = load_file(os.path.join(model_dir, "model.safetensors"))
        self.layer = self._mtp_layer(model_dir, tensors)
        self.fc = _linear(tensors["mtp.fc.weight"])
        self.norms = {n: _norm(Qwen3NextRMSNorm, tensors[f"mtp.{n}.weight"], cfg.rms_norm_eps)
                      for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}  # fmt: skip

    @staticmethod
    def _mtp_layer(model_dir: str, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        """transformers' decoder layer holding the MTP layer's tensors, converted by transformers' own
        loading: a copy of the checkpoint whose template layer holds them."""
        from transformers import Qwen3NextForCausalLM

        swapped = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
        swapped.update({f"model.layers.{TEMPLATE_LAYER}." + k[len("mtp.layers.0."):]: v
                        for k, v in tensors.items() if k.startswith("mtp.layers.0.")})  # fmt: skip
        holder = _converted(Qwen3NextForCausalLM, model_dir, swapped)
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
