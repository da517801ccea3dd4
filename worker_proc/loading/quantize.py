"""Which of a model's weights are quantized, and to what (`quantize_model`): `--quantization`.

Runs once per rank after the weights are loaded (each rank quantizes its own shard) and before the
execution plan, which then chooses among the products of each site's format. Rules:
- every product site that is `quantizable` is quantized: the attention, MLP and expert projections
  and the Mamba / Gated DeltaNet in and out projections. Routers, Qwen's one-column shared-expert
  gate, norms, convolutions, `A_log`, `D`, `dt_bias` and the embedding table stay in the model dtype;
- the LM head is quantized with `lm_head` (on by default, as llama.cpp's quantized files do). A head
  tied to the embedding table then serves the embedding lookups too: the table's dense copy is
  dropped and the lookups read the head's int8 / fp8 rows (for `int4`, whose layout has no rows to
  read, an int8 copy of the table made for the lookups);
- the scales do not depend on the TP size: a rank holding a slice of each row (a row-parallel shard)
  takes each row's max over the ranks (int8, fp8), and int4 groups lie within the slices when the
  slice widths are multiples of the group (then a rank's groups are TP=1's);
- `int4` needs an output width that is a multiple of 16 and an input width divisible by a group
  size; a weight that is not is stored `int8` instead (logged);
- the dense weight of every quantized site is replaced by an empty tensor (the memory comes back).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from shared.errors import ModelLoadError
from worker_proc.linear.formats import LINEAR_METHODS
from worker_proc.linear.site import GemmOwner, GemmSite
from worker_proc.model.hybrid import HybridForCausalLM
from worker_proc.quant.weight import (
    FORMATS,
    QuantizedWeight,
    quantize_int8,
    row_amax,
)

logger = logging.getLogger(__name__)

PROGRESS_MIN_BYTES = 256 << 20
"""Models whose product weights take at least this show a progress bar while they are quantized."""


@dataclass(frozen=True)
class QuantScheme:
    """`fmt`: one of `FORMATS`; `lm_head`: the LM head is quantized too."""

    fmt: str
    lm_head: bool = True

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantization {self.fmt!r} (choose from {', '.join(FORMATS)})")


@dataclass(frozen=True)
class QuantReport:
    """What `quantize_model` did: sites per stored format and the bytes before and after."""

    sites: dict[str, int]
    dense_bytes: int
    quantized_bytes: int

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {fmt}" for fmt, n in sorted(self.sites.items()))
        return (f"quantized {kinds} product weights: {self.dense_bytes / 2**20:.0f} MiB -> "
                f"{self.quantized_bytes / 2**20:.0f} MiB")


def quantize_weight(weight: torch.Tensor, fmt: str, amax: torch.Tensor | None = None) -> QuantizedWeight:
    """`weight` [..., out, in] in `fmt`, made by the format's `LinearMethod` (`int4` falls back to `int8` where its
    layout cannot hold it); `amax`: each row's max |w| over the whole row when `weight` holds a slice of every row."""
    q = LINEAR_METHODS[fmt].create_weight(weight, amax)
    assert q is not None, f"{fmt} is not a quantized format"
    return q


def _whole_row_amax(model: HybridForCausalLM, name: str, weight: torch.Tensor) -> torch.Tensor | None:
    """Each row's max |w| over every rank's slice when this rank holds a slice of each row of the
    parameter `name`; None when it holds whole rows."""
    spec = model.shard_spec(name)
    if model.tp.size == 1 or spec is None or spec.dim != weight.dim() - 1:
        return None
    amax = row_amax(weight)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=model.tp.group)
    return amax


def _head_sites(model: HybridForCausalLM) -> set[int]:
    head = model.lm_head.gemm if model.lm_head is not None else model.head_gemm
    return {id(head)}


@torch.no_grad()
def quantize_model(model: HybridForCausalLM, scheme: QuantScheme) -> QuantReport:
    """Quantize the model's product weights in place (see the module doc); ModelLoadError where the
    format cannot run on the model's device."""
    if scheme.fmt == "int4" and model.device.type != "cpu":
        raise ModelLoadError("--quantization int4 runs on the CPU only (torch's CPU 4-bit kernel)")
    heads = _head_sites(model)
    names = {id(p): n for n, p in model.named_parameters()}
    chosen = [(site, holder, name) for module in model.modules() if isinstance(module, GemmOwner)
              for site, holder, name in module.gemm_weights() if _selected(site, scheme, heads)]  # fmt: skip
    total = sum(getattr(h, n).numel() * getattr(h, n).element_size() for _, h, n in chosen)
    sites: dict[str, int] = {}
    dense = quantized = 0
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"quantizing to {scheme.fmt}",
               disable=total < PROGRESS_MIN_BYTES or model.tp.rank != 0)  # fmt: skip
    for site, holder, name in chosen:
        weight = getattr(holder, name)
        q = quantize_weight(weight, scheme.fmt, _whole_row_amax(model, names.get(id(weight), ""), weight))
        site.quantize(q)
        sites[q.fmt] = sites.get(q.fmt, 0) + 1
        dense += weight.numel() * weight.element_size()
        quantized += q.nbytes
        if site is model.head_gemm:
            model.embed_rows = q if q.fmt != "int4" else quantize_int8(weight)
        setattr(holder, name, nn.Parameter(weight.new_empty(0), requires_grad=False))
        bar.update(weight.numel() * weight.element_size())
    bar.close()
    report = QuantReport(sites, dense, quantized)
    logger.info("%s", report.describe())
    return report


def _selected(site: GemmSite, scheme: QuantScheme, heads: set[int]) -> bool:
    return site.quantizable and (scheme.lm_head or id(site) not in heads)
