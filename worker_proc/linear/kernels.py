"""The kernels a matrix product of a worker's model can run on (`GemmKernel`, the catalogue `KERNELS`) and the
copies of a dense weight they read (`COPIES`: oneDNN's `packed` layout, the `tiled` one of the batched-decode
kernel).

A kernel comes with what it needs: the storage it reads (`dense`, one of `COPIES`, or a quantized format's
`QuantizedWeight`, worker_proc.quant.weight), the devices, dtypes and widths it serves, whether each row's
result is independent of the row count. Which kernels a storage format offers is its `LinearMethod`'s
(worker_proc.linear.formats); which one a site runs at which row count is the execution plan's
(worker_proc.plan.execution_plan).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from worker_proc.host.memory import weight_tensor
from worker_proc.kernels import native
from worker_proc.kernels.native.layout import INT4_CHUNK, TILE_ROWS
from worker_proc.quant.weight import (
    FORMATS,
    QuantizedWeight,
    fp8_bf16,
    fp8_scaled,
    gemv_int8,
    gemv_w8a8,
    tiled_w4a8,
    tiled_w8a8,
    w4a16,
    w8a8,
    w8a16,
)


class KernelServer(Protocol):
    """A storage format's side of whether a kernel serves a site (worker_proc.linear.formats.LinearMethod)."""

    def serves(self, kernel: GemmKernel, site: SiteTraits, device: torch.device) -> bool: ...


class SiteTraits(Protocol):
    """What a product site holds that kernels and formats read (worker_proc.linear.site.GemmSite has these)."""

    shape: tuple[int, int]
    dtype: torch.dtype
    packable: bool
    experts: bool
    quantized: QuantizedWeight | None
    copies: dict[str, object]
    method: KernelServer

    @property
    def storage_format(self) -> str: ...


MIN_GEMM_ROWS = 16
"""Row count below which CPU BLAS switches to kernels whose rounding depends on the row count;
padding small inputs up to it makes every row's result independent of what it is batched with."""

PACK_ROWS = 8
"""The row count oneDNN lays a packed weight out for (a layout hint; every row count is served)."""

PACKED_ROW_STEP = 16
"""A packed product of more rows than this runs on its rows padded to a multiple of it: oneDNN creates
(compiles) and caches a primitive per row count, each costing ~0.5-4 ms once and ~2 MiB while cached,
and mixed traffic brings hundreds of prefill and batch row counts; the padding costs at most 15 rows."""


def split_gemm(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x [M, in] @ weight[out, in].T with the weight's output rows cut into `parts` equal blocks, one
    batch entry of a bmm each (the CPU bmm runs its entries on separate threads). The weight is only
    viewed, never copied."""
    rows = x.shape[0]
    blocks = weight.view(parts, weight.shape[0] // parts, weight.shape[1])
    out = torch.bmm(blocks, x.t().unsqueeze(0).expand(parts, -1, -1))  # [parts, out/parts, M]
    return out.permute(2, 0, 1).reshape(rows, weight.shape[0]).contiguous()


def gemm_parts(out_features: int) -> int:
    """How many blocks `split_gemm` cuts a weight into: one per torch thread and at least two, fewer
    when the rows do not divide evenly (1: the weight as one block)."""
    parts = max(2, torch.get_num_threads())
    while out_features % parts:
        parts -= 1
    return parts


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN weight packing applies: a CPU build with oneDNN and a dtype it packs."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight in oneDNN's packed layout (an opaque tensor only `packed_product` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ weight.T (+ bias) for a weight from `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")




@dataclass(frozen=True)
class TiledWeight:
    """A [out, in] weight in the layout of the fused batched-decode product (blocks of 16 output rows,
    worker_proc/kernels/native/tile_ops.cpp); `out_features` is the weight's own (the blocks pad it)."""

    data: torch.Tensor
    out_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def tile_weight(weight: torch.Tensor) -> TiledWeight:
    """The tiled copy, on huge pages where it is large enough (`host_memory.weight_tensor`): a step of few rows
    streams it whole, as it would the dense weight."""
    out, k = weight.shape
    buffer = weight_tensor(((out + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS * k,), weight.dtype)
    return TiledWeight(torch.ops.hyssm_cpu.tile_weight(weight.detach(), buffer), out)


def untile_weight(tiled: TiledWeight) -> torch.Tensor:
    """The [out, in] weight a `TiledWeight` was made from ([blocks][in / P][16][P] read back row by row)."""
    d = tiled.data
    rows = d.reshape(d.shape[0], d.shape[1], TILE_ROWS, -1).permute(0, 2, 1, 3)
    return rows.reshape(d.shape[0] * TILE_ROWS, -1)[: tiled.out_features].contiguous()


COPIES: dict[str, Callable[[torch.Tensor], object]] = {"packed": pack_weight, "tiled": tile_weight}
"""The storages a site makes from its dense weight when a bound method reads them (a second copy each)."""


Kernel = Callable[[torch.Tensor, torch.Tensor, object, "torch.Tensor | None"], torch.Tensor]
"""(x, the dense weight, what the site stores for the method (a packed or tiled copy, a quantized weight), bias)
-> x @ weight.T + bias."""


def padded_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear with fewer than MIN_GEMM_ROWS rows padded up to it (batch invariant)."""
    rows = x.shape[0]
    if rows >= MIN_GEMM_ROWS:
        return F.linear(x, weight, bias)
    padded = torch.cat([x, x.new_zeros(MIN_GEMM_ROWS - rows, x.shape[1])])
    return F.linear(padded, weight, bias)[:rows]


def _dense(x: torch.Tensor, weight: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _split(x: torch.Tensor, weight: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
    out = split_gemm(x, weight, gemm_parts(weight.shape[0]))
    return out if bias is None else out + bias


def _packed(x: torch.Tensor, weight: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
    assert isinstance(stored, torch.Tensor), "a packed method on a site without a packed weight"
    rows = x.shape[0]
    pad = (-rows) % PACKED_ROW_STEP if rows > PACKED_ROW_STEP else 0
    if pad:
        return packed_product(F.pad(x, (0, 0, 0, pad)), stored, bias)[:rows]
    return packed_product(x, stored, bias)


def _tiled(x: torch.Tensor, weight: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
    assert isinstance(stored, TiledWeight), "a tiled method on a site without a tiled weight"
    return torch.ops.hyssm_cpu.tiled_product(x, stored.data, stored.out_features, bias)


def _gemv(x: torch.Tensor, weight: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.hyssm_cpu.gemv(x, weight, bias)


def _gemv_seq(x: torch.Tensor, weight: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.hyssm_cpu.gemv_seq(x, weight, bias)


def _gathered(sequential: bool) -> Kernel:
    """The routed experts' product as `expert_product` runs it (worker_proc.kernels.native), here on one expert:
    how a stack's gathered call reads each chosen expert, timed and applied by the same code."""
    def run(x: torch.Tensor, weight: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
        idx = torch.zeros(x.shape[0], 1, dtype=torch.long)
        if isinstance(stored, QuantizedWeight):
            out = torch.ops.hyssm_cpu.expert_product(x, stored.data.unsqueeze(0), stored.scale.unsqueeze(0), idx,
                                                     False, True)
        else:
            out = torch.ops.hyssm_cpu.expert_product(x, weight.unsqueeze(0), None, idx, False, sequential)
        return out if bias is None else out + bias
    return run


def _padded(x: torch.Tensor, weight: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
    return padded_product(x, weight, bias)


def _quantized(fn: Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None], torch.Tensor]) -> Kernel:
    def run(x: torch.Tensor, weight: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
        assert isinstance(stored, QuantizedWeight), "a quantized method on a site without a quantized weight"
        return fn(x, stored, bias)
    return run


def _dequant_padded(x: torch.Tensor, weight: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
    assert isinstance(stored, QuantizedWeight)
    return padded_product(x, stored.dequantize(x.dtype), bias)


@dataclass(frozen=True)
class GemmKernel:
    """One way to compute x @ weight.T. `storage`: which copy of the weight it reads (`dense`, one of
    `COPIES`, or a quantized format); `batch_invariant`: each row's result does not depend on the row count;
    `devices`: the device types it runs on; `per_row_scale`: it needs a quantized weight with one scale
    per output row."""

    name: str
    storage: str
    kernel: Kernel = field(compare=False, repr=False)
    batch_invariant: bool = False
    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[torch.dtype, ...] = ()
    per_row_scale: bool = False
    quantized_copy: str = ""
    """The quantized weight's copy it reads (one of quantized.QUANTIZED_COPIES; single matrices only; the
    site makes the copy at bind: quantized.COPY_BYTES_PER_WEIGHT more), "" for none."""
    in_multiple: int = 1
    """The input width must be a multiple of this (torch's int8-weight CPU kernel reads 16 at a time)."""
    native: bool = False
    """It is one of the fused CPU kernels (worker_proc.kernels.native): offered where they load."""
    max_rows: int = 0
    """The most rows it is offered for (0: any): a few-row product is not timed against prefill steps."""
    experts_only: bool = False
    """It serves expert stacks only: the routed tokens' products over their chosen experts in one native call
    (`GemmSite.apply_gathered`), no expert list read into Python (so a step that runs it can be replayed)."""

    @property
    def reads_copy(self) -> bool:
        """It reads a second copy of the weight (one of `COPIES`, or one of a quantized weight's)."""
        return self.storage in COPIES or bool(self.quantized_copy)

    def runs_on(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> bool:
        """The kernel's own limits: device, activation dtype, input width, the native kernels built."""
        if device.type not in self.devices or self.dtypes and dtype not in self.dtypes:
            return False
        return not (shape[1] % self.in_multiple or self.native and not native.load())

    def supports(self, site: SiteTraits, device: torch.device) -> bool:
        """Whether it can run `site`'s products on `device`: one of the kernels of the site's format, within
        its own limits and the format's (worker_proc.linear.formats.LinearMethod.serves)."""
        return site.method.serves(self, site, device)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, stored: object,
              bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(x, weight, stored, bias)


ANY_DEVICE = ("cpu", "cuda", "mps", "xpu", "meta")
DENSE = GemmKernel("dense", "dense", _dense, devices=ANY_DEVICE)
SPLIT = GemmKernel("split", "dense", _split, dtypes=(torch.float32,))
PACKED = GemmKernel("packed", "packed", _packed)
TILED = GemmKernel("tiled", "tiled", _tiled, dtypes=(torch.float32, torch.bfloat16), native=True, in_multiple=2)
"""The fused product from the `tiled` copy: each weight block read once for up to eight rows, no sum reduced
across lanes; at prefill sizes a group of blocks stays in cache while every row passes over it, so one copy
can serve every row count (measured on the 350M shape: within a few percent of oneDNN's packed product at
128-512 rows, faster below)."""
GEMV = GemmKernel("gemv", "dense", _gemv, dtypes=(torch.float32, torch.bfloat16), native=True, max_rows=64)
"""The fused few-row product reading four weight rows side by side, with software prefetch."""
GEMV_SEQ = GemmKernel("gemv_seq", "dense", _gemv_seq, dtypes=(torch.float32, torch.bfloat16), native=True,
                      max_rows=64)
"""The same product reading one weight row after another, front to back, without software prefetch: which
of the two streams a weight faster is the machine's memory system's to say, so the plan times both."""
GEMV_INT8 = GemmKernel("gemv_int8", "int8", _quantized(gemv_int8), dtypes=(torch.float32, torch.bfloat16), native=True,
                       max_rows=64)
"""`gemv_seq`'s product over an int8 weight (its per-row scale applied to each finished dot product): a few-row
product streams half a bfloat16 weight's bytes."""
GEMV_W8A8 = GemmKernel("gemv_w8a8", "int8", _quantized(gemv_w8a8), batch_invariant=True, native=True, max_rows=64,
                       dtypes=(torch.float32, torch.bfloat16))
"""`w8a8` to the bit (exact integer sums), one weight row read once for up to eight rows: where the CPU multiplies
byte pairs (AVX512-VNNI) a few-row product streams the int8 weight instead of widening it."""
GATHERED = GemmKernel("gathered", "dense", _gathered(False), dtypes=(torch.float32, torch.bfloat16), native=True,
                      max_rows=64, experts_only=True)
"""An expert stack's products in one call, each chosen expert read once for its rows as `gemv` reads a weight."""
GATHERED_SEQ = GemmKernel("gathered_seq", "dense", _gathered(True), dtypes=(torch.float32, torch.bfloat16),
                          native=True, max_rows=64, experts_only=True)
"""The same, each expert read front to back as `gemv_seq` reads a weight."""
GATHERED_INT8 = GemmKernel("gathered_int8", "int8", _gathered(True), dtypes=(torch.float32, torch.bfloat16),
                           native=True, max_rows=64, experts_only=True)
"""An int8 stack's products in one call: `gemv_int8`'s arithmetic (row scales on float32 activations)."""
PADDED = GemmKernel("padded", "dense", _padded, batch_invariant=True)
W8A16 = GemmKernel("w8a16", "int8", _quantized(w8a16), in_multiple=16)
def _w8a8(x: torch.Tensor, weight: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
    """`w8a8`; on the CPU where the fused kernels load, its rows' quantization and the scaling of the integer
    product run fused (w8a8_ops.cpp `quantize_rows`, `scale_int32`: the same values to the bit, one pass each
    instead of the six elementwise passes over the activations and the four over the output)."""
    assert isinstance(stored, QuantizedWeight), "a quantized method on a site without a quantized weight"
    if x.is_cuda or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or not native.load():
        return w8a8(x, stored, bias)
    xq, xs = torch.ops.hyssm_cpu.quantize_rows(x if x.stride(-1) == 1 else x.contiguous())
    out = torch.ops.hyssm_cpu.scale_int32(torch._int_mm(xq, stored.data.t()), xs, stored.scale, x.dtype)
    return out if bias is None else out + bias


W8A8 = GemmKernel("w8a8", "int8", _w8a8, batch_invariant=True, devices=("cpu", "cuda"))
TILED_W8A8 = GemmKernel("tiled_w8a8", "int8", _quantized(tiled_w8a8), batch_invariant=True, native=True,
                        dtypes=(torch.float32, torch.bfloat16), in_multiple=4, quantized_copy="tiled")
"""`w8a8` to the bit over the tiled int8 copy: a batched decode step's rows multiplied into 16 outputs at once,
64 byte pairs an instruction where the CPU has AVX512-VNNI (no sum reduced across lanes, as `tiled`)."""
W4A16 = GemmKernel("w4a16", "int4", _quantized(w4a16), batch_invariant=True)
TILED_OVER_INT4 = GemmKernel("tiled_over_int4", "int4", _quantized(tiled_w8a8), batch_invariant=True, native=True,
                             dtypes=(torch.float32, torch.bfloat16), in_multiple=4, quantized_copy="tiled")
"""`tiled_w8a8` over an int8 copy of a 4-bit matrix (its values quantized per row): the product of more rows than
torch's 4-bit kernel serves well (one pass over the weight per row)."""
TILED_W4A8 = GemmKernel("tiled_w4a8", "int4", _quantized(tiled_w4a8), batch_invariant=True, native=True,
                        dtypes=(torch.float32, torch.bfloat16), in_multiple=INT4_CHUNK, quantized_copy="tiled4")
"""The 4-bit values themselves in a tiled copy, by int8 rows of x: half `tiled_over_int4`'s copy bytes."""
FP8_BF16 = GemmKernel("fp8_bf16", "fp8", _quantized(fp8_bf16), per_row_scale=True)
FP8_SCALED = GemmKernel("fp8_scaled", "fp8", _quantized(fp8_scaled), devices=("cuda",), per_row_scale=True)
DEQUANT = {fmt: GemmKernel(f"dequant_{fmt}", fmt, _dequant_padded, batch_invariant=True, devices=ANY_DEVICE)
           for fmt in FORMATS}
"""Every format's reference product (the weight materialised, padded like PADDED): any device."""
KERNELS = {m.name: m for m in (DENSE, SPLIT, PACKED, TILED, GEMV, GEMV_SEQ, GATHERED, GATHERED_SEQ, GATHERED_INT8,
                               GEMV_INT8, GEMV_W8A8, PADDED, W8A16, W8A8,
                               TILED_W8A8, W4A16, TILED_OVER_INT4, TILED_W4A8, FP8_BF16,
                               FP8_SCALED, *DEQUANT.values())}
