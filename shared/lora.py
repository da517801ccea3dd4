"""Reading and checking a PEFT LoRA adapter against the served model, torch-free (the tokenizer and the
scheduler register adapters; the workers read the same files again when an adapter enters a slot).

An adapter is a directory as `peft` saves it: `adapter_config.json` and `adapter_model.safetensors`, whose
tensors are `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], `<module>` a
transformers module name. A module name becomes the served model's through the family's checkpoint renames
(`HybridConfig.renames`): the decoder's linear layers carry their checkpoint names (worker_proc.model), so
every linear layer PEFT can wrap in a supported family is exactly one of the model's (`linear_layers`, the
names and [out, in] shapes of the whole, unsharded model). Rules that hold for an adapter `read_adapter`
returns:
- peft_type LORA, a plain LoRA (no DoRA, no LoRA bias, no `modules_to_save`, no trainable tokens, no
  `target_parameters`, one rank and one alpha for every module: no `rank_pattern` / `alpha_pattern`);
  `lora_dropout` is a training setting and is ignored;
- 1 <= r <= max_rank; scaling = lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`);
- every entry of a `target_modules` list names a linear layer of the model (PEFT's rule: the module's name
  or its last dotted parts); a regex string must compile (the tensors then say which modules it matched);
- every tensor is the A or B of a decoder linear layer, in a float dtype, A [r, in] and B [out, r] with
  [out, in] the layer's shape (an adapter trained on another base model fails here), both present;
- `uid` = sha256 over both files' bytes; `targets` = the model's names of the layers it changes, sorted.
Every refusal is a `LoraError` of one line naming the adapter and the problem.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterator

from shared.messages.lora import LoraAdapter
from shared.model_config import Block, HybridConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_MAX_HEADER = 100 << 20
_REFUSED_OPTIONS = (  # (config field, why it is refused when set)
    ("use_dora", "DoRA (use_dora) is not supported"),
    ("lora_bias", "a LoRA bias (lora_bias) is not supported"),
    ("modules_to_save", "modules_to_save (fully trained copies of base modules) is not supported: only the "
                        "LoRA matrices of linear layers are served"),
    ("trainable_token_indices", "trainable_token_indices (trained embedding rows) is not supported"),
    ("target_parameters", "target_parameters (LoRA on parameters such as MoE expert stacks) is not supported"),
    ("rank_pattern", "rank_pattern (a rank per module) is not supported: one rank for every module"),
    ("alpha_pattern", "alpha_pattern (an alpha per module) is not supported: one lora_alpha for every module"),
    ("fan_in_fan_out", "fan_in_fan_out (Conv1D weights) is not supported"),
    ("use_qalora", "QALoRA (use_qalora) is not supported"),
)


class LoraError(ValueError):
    """An adapter that cannot be served (one line, naming the adapter and the problem)."""


def _block_linears(block: Block, cfg: HybridConfig) -> Iterator[tuple[str, int, int]]:
    """(name under the block, out, in) of every linear layer of `block`, unsharded."""
    hidden, size, a, m, g = cfg.hidden_size, block.size, cfg.attn, cfg.mamba, cfg.gdn
    if block.kind == "attention":
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        yield from (("q_proj", q * (2 if a.output_gate else 1), hidden), ("k_proj", kv, hidden),
                    ("v_proj", kv, hidden), ("o_proj", hidden, q))
    elif block.kind == "mamba":
        conv = m.intermediate + 2 * m.n_groups * m.d_state
        yield from (("in_proj", m.intermediate + conv + m.n_heads, hidden), ("out_proj", hidden, m.intermediate))
    elif block.kind == "gdn":
        key, value = g.k_heads * g.k_dim, g.v_heads * g.v_dim
        if g.fused_proj:
            yield from (("in_proj_qkvz", 2 * key + 2 * value, hidden), ("in_proj_ba", 2 * g.v_heads, hidden))
        else:
            yield from (("in_proj_qkv", 2 * key + value, hidden), ("in_proj_z", value, hidden),
                        ("in_proj_b", g.v_heads, hidden), ("in_proj_a", g.v_heads, hidden))
        yield "out_proj", hidden, value
    elif block.kind == "short_conv":
        yield from (("in_proj", 3 * hidden, hidden), ("out_proj", hidden, hidden))
    elif block.kind == "mamba1":
        inner = cfg.mamba1.d_inner
        yield from (("in_proj", 2 * inner, hidden), ("out_proj", hidden, inner))
    elif block.kind == "fused_gated_mlp":
        yield from (("input_linear", 2 * size, hidden), ("output_linear", hidden, size))
    elif block.kind == "gated_mlp":
        yield from (("gate_proj", size, hidden), ("up_proj", size, hidden), ("down_proj", hidden, size))
    elif block.kind == "relu2_mlp":
        yield from (("up_proj", size, hidden), ("down_proj", hidden, size))
    elif block.kind == "sigmoid_moe":
        shared, latent = cfg.moe.shared_size, cfg.moe.latent_size
        if shared:
            yield from (("shared_experts.up_proj", shared, hidden), ("shared_experts.down_proj", hidden, shared))
        if latent:
            yield from (("fc1_latent_proj", latent, hidden), ("fc2_latent_proj", hidden, latent))
    elif block.kind == "shared_gate_moe" and cfg.moe.shared_size:
        shared = cfg.moe.shared_size
        yield from (("shared_expert.gate_proj", shared, hidden), ("shared_expert.up_proj", shared, hidden),
                    ("shared_expert.down_proj", hidden, shared), ("shared_expert_gate", 1, hidden))


def linear_layers(cfg: HybridConfig) -> dict[str, tuple[int, int]]:
    """Every linear layer of the decoder an adapter may change: the model's module name
    (`model.layers.N.<block>.<proj>`) -> its unsharded [out, in]. MoE expert stacks and routers, the LM head,
    the embeddings, MTP layers and a vision tower take no adapter and are not listed."""
    out: dict[str, tuple[int, int]] = {}
    for i, layer in enumerate(cfg.layers()):
        for sub in layer:
            for block in sub.blocks:
                for name, rows, cols in _block_linears(block, cfg):
                    out[f"model.layers.{i}.{block.name}.{name}"] = (rows, cols)
    return out


def model_module(peft_module: str, cfg: HybridConfig) -> str:
    """The served model's name of the transformers module `peft_module` (the family's renames)."""
    name = peft_module + ".weight"
    for pattern, repl in cfg.renames:
        name = re.sub(pattern, repl, name)
    return name.removesuffix(".weight")


def lora_tensor(key: str, cfg: HybridConfig) -> tuple[str, str] | None:
    """(the model's module name, "A" | "B") of an adapter tensor name, None when it is no LoRA matrix."""
    m = _TENSOR.match(key)
    return None if m is None else (model_module(m["module"], cfg), m["part"])


def safetensors_header(path: str) -> dict[str, dict]:
    """The tensors of a safetensors file (name -> {"dtype", "shape", ...}) from its header alone."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < size <= _MAX_HEADER:
            raise ValueError("not a safetensors file (bad header length)")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (header is not an object)")
    header.pop("__metadata__", None)
    return header


def adapter_digest(path: str) -> str:
    """sha256 over the adapter's config and weight files (names and bytes): its `uid`."""
    h = hashlib.sha256()
    for fname in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(fname.encode() + b"\0")
        with open(os.path.join(path, fname), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def _read_config(path: str) -> dict:
    cfg_path, weights = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise LoraError(f"{path} is not a directory")
    if not os.path.isfile(cfg_path):
        raise LoraError(f"{path} has no {CONFIG_FILE} (not a PEFT adapter directory)")
    if not os.path.isfile(weights):
        other = " (only safetensors adapters are read: save with safe_serialization=True)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise LoraError(f"{path} has no {WEIGHTS_FILE}{other}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise LoraError(f"{cfg_path}: unreadable ({e})") from e
    if not isinstance(raw, dict):
        raise LoraError(f"{cfg_path}: not a JSON object")
    return raw


def _check_options(raw: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a config that names a plain LoRA; LoraError (without the path) otherwise."""
    if raw.get("peft_type") != "LORA":
        raise LoraError(f"peft_type {raw.get('peft_type')!r} is not LORA")
    for key, why in _REFUSED_OPTIONS:
        if raw.get(key):
            raise LoraError(why)
    if raw.get("bias", "none") != "none":
        raise LoraError(f"bias {raw['bias']!r} (trained base biases) is not supported: only bias 'none'")
    r, alpha = raw.get("r"), raw.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"rank r {r!r} is not a positive integer")
    if r > max_rank:
        raise LoraError(f"rank {r} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoraError(f"lora_alpha {alpha!r} is not a number")
    return r, float(alpha) / (math.sqrt(r) if raw.get("use_rslora") else r)


def _names_layer(target: str, layer: str, cfg: HybridConfig) -> bool:
    """Whether PEFT's suffix rule matches `target` to the model's `layer` under its checkpoint name: the
    layer's own name, or the name whose last components are `target` and which the family renames to it
    (LFM2's `w1` is the served `gate_proj`)."""
    if layer == target or layer.endswith("." + target):
        return True
    parts = layer.split(".")
    tail = target.split(".")
    return len(parts) > len(tail) and model_module(".".join(parts[: -len(tail)] + tail), cfg) == layer


def _check_targets(raw: dict, layers: dict[str, tuple[int, int]], cfg: HybridConfig) -> None:
    """Every entry of a `target_modules` list names a linear layer of the model (PEFT's suffix rule, over the
    checkpoint's names)."""
    arch = cfg.architecture
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise LoraError(f"target_modules regex {targets!r} does not compile ({e})") from e
        return
    if not isinstance(targets, list) or not targets:
        raise LoraError(f"target_modules {targets!r} is neither a list of module names nor a regex")
    for t in targets:
        if not isinstance(t, str) or not any(_names_layer(t, n, cfg) for n in layers):
            what = ("the LM head and the embeddings take no adapter" if t in ("lm_head", "embed_tokens", "embeddings")
                    else f"{arch} has no linear layer of that name")
            raise LoraError(f"target module {t!r}: {what}")


def _refusal(module: str, arch: str) -> str:
    if ".experts." in module or module.endswith(".experts"):
        return f"{module} is an MoE expert: LoRA on routed experts is not supported"
    if module.startswith(("lm_head", "model.embed_tokens")):
        return f"{module}: the LM head and the embeddings take no adapter"
    return f"{module} is not a linear layer of this {arch} model (an adapter of another base model?)"


def _check_tensors(header: dict[str, dict], cfg: HybridConfig, rank: int) -> tuple[str, ...]:
    """The model's names of the layers the tensors change; LoraError on any tensor that does not fit."""
    layers = linear_layers(cfg)
    parts: dict[str, set[str]] = {}
    for key, info in header.items():
        hit = lora_tensor(key, cfg)
        if hit is None:
            raise LoraError(f"tensor {key!r} is not a LoRA matrix (lora_A / lora_B weight) of a module")
        module, part = hit
        if module not in layers:
            raise LoraError(f"tensor {key!r}: {_refusal(module, cfg.architecture)}")
        if info.get("dtype") not in _FLOAT_DTYPES:
            raise LoraError(f"tensor {key!r} has dtype {info.get('dtype')}, not a float dtype")
        out, inp = layers[module]
        want = [rank, inp] if part == "A" else [out, rank]
        if list(info.get("shape", ())) != want:
            raise LoraError(f"tensor {key!r} has shape {info.get('shape')}, expected {want} for {module} "
                            f"[{out}, {inp}] of this {cfg.architecture} model at rank {rank} (an adapter of another "
                            "base model?)")
        parts.setdefault(module, set()).add(part)
    lone = sorted(m for m, p in parts.items() if len(p) != 2)
    if lone:
        raise LoraError(f"{lone[0]} has lora_{next(iter(parts[lone[0]]))} without its other matrix")
    if not parts:
        raise LoraError("the adapter holds no LoRA tensors")
    return tuple(sorted(parts))


def read_adapter(name: str, path: str, cfg: HybridConfig, max_rank: int) -> LoraAdapter:
    """The checked adapter at `path` for the model `cfg` (the rules of the module doc); LoraError otherwise."""
    path = os.path.abspath(path)
    raw = _read_config(path)
    try:
        rank, scaling = _check_options(raw, max_rank)
        _check_targets(raw, linear_layers(cfg), cfg)
        try:
            header = safetensors_header(os.path.join(path, WEIGHTS_FILE))
        except (OSError, ValueError) as e:
            raise LoraError(f"{WEIGHTS_FILE}: {e}") from e
        targets = _check_tensors(header, cfg, rank)
    except LoraError as e:
        raise LoraError(f"adapter {name!r} at {path}: {e}") from e
    return LoraAdapter(name=name, path=path, uid=adapter_digest(path), rank=rank, scaling=scaling, targets=targets)
