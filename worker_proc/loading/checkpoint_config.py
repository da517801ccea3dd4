"""What a pre-quantized checkpoint declares: `config.json`'s `quantization_config` -> `CheckpointQuant`.

Read once per rank before the model is built (worker_proc.loading.prequantized loads the weights as it says).
Accepted, everything else a `ModelLoadError` naming the method or scheme:
- `quant_method: "fp8"` with `weight_block_size` [rows, cols] (DeepSeek / Qwen FP8 checkpoints): e4m3
  `weight` and float32 `weight_scale_inv` per block; `activation_scheme` dynamic or static;
  `modules_to_not_convert` / `ignored_layers` name the modules stored unquantized;
- `quant_method: "compressed-tensors"` (llm-compressor's checkpoints), per config group: `int-quantized`
  (or `naive-quantized`) 8-bit symmetric integer weights per channel or tensor (W8A8, INT8);
  `float-quantized` e4m3 weights per channel, tensor or block (FP8, FP8_DYNAMIC, FP8_BLOCK);
  `pack-quantized` 4-bit integer weights per group or channel, symmetric or not (W4A16, W4A16_ASYM),
  without activation-ordered groups. `ignore` names the modules stored unquantized.
Which modules are quantized is read from the tensors themselves (a module with a scale or packed
tensor is); the config supplies how. Activation quantization declared by a checkpoint is not
reproduced: activations are quantized (or not) by the products the execution plan picks, per row
at run time, and static activation or KV-cache scales are skipped (logged by the loader).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shared.errors import ModelLoadError

SUPPORTED = "fp8 block-wise, compressed-tensors int8 / fp8 / 4-bit packed"
INT4_BITS = 4


@dataclass(frozen=True)
class StoredScheme:
    """How the weight of a quantized checkpoint module is stored. `kind`: `fp8` (e4m3 `weight` and a
    scale), `int8` (int8 `weight` and a scale) or `int4` (`weight_packed`); `scale_name`: the scale
    tensor's suffix; `strategy`: `block` ([rows, cols] = `block`), `channel`, `tensor` or `group`
    (`group` inputs per scale); `symmetric`: no zero point; `targets`: compressed-tensors targets."""

    kind: str
    scale_name: str
    strategy: str
    block: tuple[int, int] = (0, 0)
    group: int = 0
    symmetric: bool = True
    targets: tuple[str, ...] = ("Linear",)

    def __post_init__(self) -> None:
        if self.kind not in ("fp8", "int8", "int4"):
            raise ValueError(f"unknown stored kind {self.kind!r}")
        if (self.strategy == "block") != (min(self.block) > 0):
            raise ValueError("block strategy needs a positive block shape (and only it has one)")
        if (self.strategy == "group") != (self.group > 0):
            raise ValueError("group strategy needs a positive group size (and only it has one)")
        if self.kind != "int4" and not self.symmetric:
            raise ValueError("only 4-bit weights may have zero points")

    @property
    def fmt(self) -> str:
        """The hyssm format (worker_proc.quant.weight) these weights are held in."""
        return self.kind

    def describe(self) -> str:
        if self.kind == "int4":
            how = f"group {self.group}" if self.group else "per channel"
            return f"W4A16 {how} {'symmetric' if self.symmetric else 'asymmetric'}"
        values = "e4m3" if self.kind == "fp8" else self.kind
        if self.strategy == "block":
            return f"{values} {self.block[0]}x{self.block[1]} blocks"
        return f"{values} per {self.strategy}"

    def matches(self, module: str) -> bool:
        return any(_target_matches(t, module) for t in self.targets)


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quantization: `method` (`fp8` | `compressed-tensors`), its schemes (first
    matching one wins), the names it stores unquantized and whether it declares static activation
    scales (not used: see the module doc)."""

    method: str
    schemes: tuple[StoredScheme, ...]
    ignore: tuple[str, ...] = ()
    static_activations: bool = False

    def __post_init__(self) -> None:
        if not self.schemes:
            raise ValueError("a quantized checkpoint has at least one scheme")

    @property
    def formats(self) -> frozenset[str]:
        return frozenset(s.fmt for s in self.schemes)

    def scheme_for(self, module: str) -> StoredScheme:
        """The scheme of a module the checkpoint stores quantized."""
        for s in self.schemes:
            if s.matches(module):
                return s
        if len(self.schemes) == 1:
            return self.schemes[0]
        raise ModelLoadError(f"no quantization_config group of this checkpoint targets {module!r}")

    def ignored(self, module: str) -> bool:
        return any(_target_matches(t, module) for t in self.ignore)

    def describe(self) -> str:
        kinds = ", ".join(dict.fromkeys(s.describe() for s in self.schemes))
        return f"{self.method} {kinds}"


def _target_matches(target: str, module: str) -> bool:
    """compressed-tensors' target spelling: `re:<pattern>` (matched from the name's start), a layer
    class name (`Linear`: every product module) or a module name (the whole name or its tail)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    if target == "Linear":
        return True
    return module == target or module.endswith("." + target)


def parse_quantization_config(raw: Any, source: str) -> CheckpointQuant | None:
    """The checkpoint's quantization (None: a dense checkpoint). `source` names config.json in errors."""
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source}: quantization_config must be an object")
    method = raw.get("quant_method")
    if method == "fp8":
        return _fp8_block(raw, source)
    if method == "compressed-tensors":
        return _compressed_tensors(raw, source)
    raise ModelLoadError(f"{source}: quantization_config quant_method {method!r} is not supported "
                         f"(supported: {SUPPORTED})")


def _fp8_block(raw: dict[str, Any], source: str) -> CheckpointQuant:
    block = raw.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{source}: quant_method fp8 without weight_block_size [rows, cols] (per-tensor fp8) "
                             "is not supported")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"{source}: fp8 format {raw.get('fmt')!r} is not supported (e4m3 only)")
    activations = raw.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise ModelLoadError(f"{source}: fp8 activation_scheme {activations!r} is not supported")
    ignore = tuple(raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ())
    scheme = StoredScheme("fp8", "weight_scale_inv", "block", block=(block[0], block[1]))
    return CheckpointQuant("fp8", (scheme,), ignore, static_activations=activations == "static")


def _compressed_tensors(raw: dict[str, Any], source: str) -> CheckpointQuant:
    for key in ("sparsity_config", "transform_config"):
        if raw.get(key):
            raise ModelLoadError(f"{source}: compressed-tensors {key} is not supported")
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{source}: compressed-tensors quantization_config has no config_groups")
    schemes, static = [], False
    for name, group in groups.items():
        scheme, group_static = _ct_group(group, raw.get("format"), f"{source}: compressed-tensors group {name!r}")
        schemes.append(scheme)
        static = static or group_static
    static = static or bool(raw.get("kv_cache_scheme"))
    return CheckpointQuant("compressed-tensors", tuple(schemes), tuple(raw.get("ignore") or ()), static)


def _ct_group(group: dict[str, Any], default_format: str | None, where: str) -> tuple[StoredScheme, bool]:
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ModelLoadError(f"{where}: quantizes no weights (activation-only schemes are not supported)")
    fmt = group.get("format") or default_format
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    symmetric = bool(weights.get("symmetric", True))
    targets = tuple(group.get("targets") or ("Linear",))
    label = f"{bits}-bit {kind} {strategy} weights ({fmt})"
    if weights.get("actorder") == "group":
        raise ModelLoadError(f"{where}: activation-ordered groups (actorder 'group') are not supported")
    if weights.get("dynamic"):
        raise ModelLoadError(f"{where}: dynamic weight quantization is not supported")
    acts = group.get("input_activations")
    static = isinstance(acts, dict) and not acts.get("dynamic", False)
    if kind == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized"):
        if strategy == "block":
            block = weights.get("block_structure") or []
            if len(block) != 2:
                raise ModelLoadError(f"{where}: block strategy without a block_structure")
            return StoredScheme("fp8", "weight_scale", "block", block=(int(block[0]), int(block[1])),
                                targets=targets), static
        if strategy in ("channel", "tensor") and symmetric:
            return StoredScheme("fp8", "weight_scale", strategy, targets=targets), static
    if kind == "int" and bits == 8 and fmt in ("int-quantized", "naive-quantized"):
        if strategy in ("channel", "tensor") and symmetric:
            return StoredScheme("int8", "weight_scale", strategy, targets=targets), static
    if kind == "int" and bits == INT4_BITS and fmt == "pack-quantized" and strategy in ("group", "channel"):
        group_size = int(weights.get("group_size") or 0) if strategy == "group" else 0
        if strategy == "group" and group_size <= 0:
            raise ModelLoadError(f"{where}: group strategy without a group_size")
        return StoredScheme("int4", "weight_scale", strategy, group=group_size, symmetric=symmetric,
                            targets=targets), static
    raise ModelLoadError(f"{where}: {'symmetric' if symmetric else 'asymmetric'} {label} are not supported "
                         f"(supported: {SUPPORTED})")


def check_requested(requested: str, quant: CheckpointQuant, source: str) -> None:
    """`--quantization` given with a pre-quantized checkpoint must name a format it is stored in."""
    if requested and requested not in quant.formats:
        stored = " / ".join(sorted(quant.formats))
        raise ModelLoadError(f"{source}: the checkpoint is stored quantized ({quant.describe()}, held as {stored}); "
                             f"--quantization {requested} would re-quantize quantized weights: drop it or pass "
                             f"--quantization {sorted(quant.formats)[0]}")
