"""Loading a pre-quantized checkpoint (`load_prequantized`) without ever building its dense weights.

worker_proc.loading.checkpoint calls this when config.json declares a `quantization_config`
(worker_proc.loading.checkpoint_config says which are accepted). Steps, per rank:
1. every checkpoint module with a scale or packed tensor is a quantized module; its weight's
   parameter (the family's renames applied, expert j of a stack as row j) and product site decide
   how it is held: in its format on the site, or dequantized into a dense parameter where the site
   cannot hold it (its scheme's method says, worker_proc.loading.stored_methods; a router, a tied
   embedding table);
2. the model is built on the meta device and materialised on the real one with a zero-size tensor in
   place of every parameter held quantized (its dense weight never exists); buffers derived from
   the config are remade there (`derive_buffers`; a buffer left on the meta device is an error);
3. the dense tensors load as for any checkpoint (worker_proc.loading.weight_files.load_weights), the quantized
   modules' tensors are read by their scheme's method, each rank reading only its slice of values and
   scales, an expert stack's matrices stacked into one weight; a site holding one takes that method;
4. static activation and KV-cache scales (not used: activations are quantized by the products the
   plan picks) are skipped; what was detected and how each product is held is logged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

from shared.errors import ModelLoadError
from shared.model_config import HybridConfig
from worker_proc.linear.site import GemmOwner, GemmSite
from worker_proc.loading.checkpoint_config import CheckpointQuant, StoredScheme
from worker_proc.loading.checkpoint_formats import Part, stack
from worker_proc.loading.stored_methods import StoredLinear, stored_method
from worker_proc.loading.weight_files import MappedFile, _Names, load_weights
from worker_proc.model.hybrid import HybridForCausalLM
from worker_proc.model.shard import Range, ShardSpec, TPInfo

logger = logging.getLogger(__name__)

MARKERS = ("weight_scale_inv", "weight_scale", "weight_packed")
"""A module with one of these tensors is stored quantized."""
MODULE_TENSORS = ("weight", "weight_scale_inv", "weight_scale", "weight_packed", "weight_zero_point", "weight_shape")
UNUSED = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "k_scale", "v_scale",
          "activation_scale")
"""Static activation / KV-cache scales of a checkpoint: skipped (see the module doc)."""
EMBEDDING = "model.embed_tokens.weight"
_LAYER = re.compile(r"^model\.layers\.\d+\.")


@dataclass(frozen=True)
class QuantModule:
    """A module the checkpoint stores quantized: its name, its scheme's method, the parameter (and expert row) its
    weight fills, this rank's part, and why it is loaded dense ("" = held in its format)."""

    prefix: str
    method: StoredLinear
    param: str
    row: int | None
    part: Part
    dense_reason: str
    experts: int = 0  # the stack's expert count (0: a single matrix)


class _Tensors:
    """The checkpoint's files and which holds each tensor; `read` is a checkpoint_formats.Read. Each file
    is a `MappedFile` (worker_proc.loading.weight_files), so only a bounded part of it is mapped at a time."""

    def __init__(self, files: dict[str, list[str]], stack_: ExitStack) -> None:
        self.where: dict[str, MappedFile] = {}
        for path in files:
            mapped = MappedFile(path)
            stack_.callback(mapped.close)
            try:
                keys = mapped.handle().keys()
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise ModelLoadError(f"{path}: cannot read safetensors ({e})") from e
            for key in keys:
                self.where[key] = mapped

    def shape(self, key: str) -> list[int]:
        return list(self.where[key].handle().get_slice(key).get_shape())

    def read(self, key: str, dim: int, ranges: tuple[Range, ...] | None) -> torch.Tensor:
        if key not in self.where:
            raise ModelLoadError(f"checkpoint lacks tensor {key!r}")
        handle = self.where[key].for_tensor(key)
        if ranges is None:
            return handle.get_tensor(key)
        sl = handle.get_slice(key)
        lead = (slice(None),) * dim
        parts = [sl[(*lead, slice(a, b))] for a, b in ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _site_table(model: nn.Module) -> dict[str, GemmSite]:
    """Parameter name -> the product site multiplying it."""
    names = {id(m): n for n, m in model.named_modules()}
    table: dict[str, GemmSite] = {}
    for module in model.modules():
        if isinstance(module, GemmOwner):
            for site, holder, attr in module.gemm_weights():
                owner = names[id(holder)]
                table[f"{owner}.{attr}" if owner else attr] = site
    return table


def quantized_modules(tensors: _Tensors, quant: CheckpointQuant, model: HybridForCausalLM,
                      device: torch.device) -> list[QuantModule]:
    """Every module the checkpoint stores quantized, with how this rank holds it (module doc, step 1)."""
    names, sites = _Names(model), _site_table(model)
    prefixes = sorted({k.rsplit(".", 1)[0] for k in tensors.where if k.rsplit(".", 1)[-1] in MARKERS})
    out = []
    methods: dict[StoredScheme, StoredLinear] = {}  # one method per scheme, shared by its sites
    for prefix in prefixes:
        if f"{prefix}.weight_g_idx" in tensors.where:
            raise ModelLoadError(f"{prefix}: activation-ordered groups (weight_g_idx) are not supported")
        param, row = names.resolve(f"{prefix}.weight")
        if names.ignore(param):
            continue
        target = names.params.get(param)
        if target is None or (param == "lm_head.weight" and model.lm_head is None):
            raise ModelLoadError(f"unexpected quantized module {prefix!r} (not a parameter of the model)")
        scheme = quant.scheme_for(prefix)
        method = methods.setdefault(scheme, stored_method(scheme))
        part = Part(_whole_shape(tensors, prefix, scheme), _spec(model, param, row))
        local = tuple(target.shape[1:] if row is not None else target.shape)
        if part.local != local:
            raise ModelLoadError(f"quantized module {prefix!r} holds {part.local} on this rank, expected {local}")
        site = sites.get(param)
        reason = (
            "not a product" if site is None else "kept in the model dtype" if not site.quantizable
            else "embedding table" if param == EMBEDDING else method.layout_problem(part, device)
        )
        out.append(QuantModule(prefix, method, param, row, part, reason, target.shape[0] if row is not None else 0))
    return out


def _whole_shape(tensors: _Tensors, prefix: str, scheme: StoredScheme) -> tuple[int, int]:
    if scheme.kind == "int4":
        shape = [int(x) for x in tensors.read(f"{prefix}.weight_shape", 0, None).tolist()]
    else:
        shape = tensors.shape(f"{prefix}.weight")
    if len(shape) != 2:
        raise ModelLoadError(f"quantized module {prefix!r} has a {len(shape)}-d weight (expected a matrix)")
    return shape[0], shape[1]


def _spec(model: HybridForCausalLM, param: str, row: int | None) -> ShardSpec | None:
    spec = model.shard_spec(param)
    if spec is not None and row is not None:  # one expert of a stacked [E, ...] parameter
        spec = ShardSpec(spec.dim - 1, spec.ranges) if spec.dim > 0 else None
    return spec


def materialize_(model: HybridForCausalLM, device: torch.device, empty: frozenset[str]) -> None:
    """Give a meta-built model real storage on `device`: a zero-size tensor for every parameter named
    in `empty`, uninitialised ones of their shapes for the others, and its derived buffers remade."""
    for mname, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            shape = (0,) if full in empty else tuple(p.shape)
            module._parameters[pname] = nn.Parameter(torch.empty(shape, dtype=p.dtype, device=device),
                                                     requires_grad=False)
        derive = getattr(module, "derive_buffers", None)
        if callable(derive):
            derive(device)
        stale = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if stale:
            raise AssertionError(f"{mname}.{stale[0]} stays on the meta device (no derive_buffers)")
    model.device = device


def _by_param(modules: list[QuantModule]) -> Iterator[tuple[str, list[QuantModule]]]:
    groups: dict[str, list[QuantModule]] = {}
    for m in modules:
        groups.setdefault(m.param, []).append(m)
    for param, ms in groups.items():
        yield param, sorted(ms, key=lambda m: -1 if m.row is None else m.row)


def _load_modules(model: HybridForCausalLM, modules: list[QuantModule], tensors: _Tensors,
                  device: torch.device) -> dict[str, int]:
    """Read every quantized module into its site or dense parameter; {how held: count of products}."""
    sites, params = _site_table(model), dict(model.named_parameters())
    counts: dict[str, int] = {}
    for param, ms in _by_param(modules):
        rows = [m.row for m in ms]
        stacked = rows[0] is not None
        if stacked and rows != list(range(ms[0].experts)):
            raise ModelLoadError(f"{param}: the checkpoint stores experts {rows} quantized, the model has "
                                 f"{ms[0].experts}")
        if ms[0].dense_reason:
            with torch.no_grad():
                for m in ms:
                    dense = m.method.read_dense(tensors.read, m.prefix, m.part, device)
                    (params[param] if m.row is None else params[param][m.row]).copy_(dense)
            key = f"dequantized to {model.dtype} ({ms[0].dense_reason})".replace("torch.", "")
        else:
            held = [m.method.read_weight(tensors.read, m.prefix, m.part, device) for m in ms]
            q = stack(held) if stacked else held[0]
            sites[param].quantize(q, ms[0].method)
            key = q.fmt if q.fmt != "int4" else f"int4 ({str(q.scale.dtype).removeprefix('torch.')} scales)"
        counts[key] = counts.get(key, 0) + 1
    return counts


def load_prequantized(cfg: HybridConfig, quant: CheckpointQuant, files: dict[str, list[str]], dtype: torch.dtype,
                      device: torch.device, tp: TPInfo, mtp: bool = False) -> HybridForCausalLM:
    """The model of a pre-quantized checkpoint on `device` (see the module doc); `mtp`: with its MTP layers."""
    if "int4" in quant.formats and device.type != "cpu":
        raise ModelLoadError(f"{quant.describe()}: 4-bit weights run on the CPU only (torch's CPU 4-bit kernel)")
    model = HybridForCausalLM(cfg, dtype, "meta", tp, mtp=mtp)
    with ExitStack() as opened:
        tensors = _Tensors(files, opened)
        modules = quantized_modules(tensors, quant, model, device)
        held = frozenset(m.param for m in modules if not m.dense_reason)
        materialize_(model, device, held)
        own = {f"{m.prefix}.{t}" for m in modules for t in MODULE_TENSORS}
        unused = [k for k in tensors.where if k.rsplit(".", 1)[-1] in UNUSED]
        load_weights(model, files, skip=lambda k: k in own or k.rsplit(".", 1)[-1] in UNUSED,
                     loaded_elsewhere=frozenset(m.param for m in modules))
        counts = _load_modules(model, modules, tensors, device)
    dense = sorted({n.removesuffix(".weight") for n, s in _site_table(model).items()
                    if s.quantizable and s.quantized is None and n not in {m.param for m in modules}})
    kept = f"; kept {dtype}: {_names(dense)}".replace("torch.", "") if dense else ""
    skipped = f"; {len(unused)} static activation / KV-cache scales not used" if unused else ""
    logger.info("pre-quantized checkpoint, %s: %s products%s%s", quant.describe(),
                ", ".join(f"{n} {how}" for how, n in sorted(counts.items())), kept, skipped)
    return model


def _names(params: list[str]) -> str:
    """Module names for the log, one entry per name within a layer with the count of layers."""
    counts: dict[str, int] = {}
    for p in params:
        short = "lm_head (tied)" if p == EMBEDDING.removesuffix(".weight") else _LAYER.sub("", p)
        counts[short] = counts.get(short, 0) + 1
    return ", ".join(n if c == 1 else f"{n} x{c}" for n, c in counts.items())
