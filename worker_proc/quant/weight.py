"""Quantized weight storages (`QuantizedWeight`) and the products that read them.

A quantized site holds one `QuantizedWeight` in place of its dense weight (worker_proc.model.quantization
decides which sites are quantized; the execution plan which of a format's products runs at which row
count). Formats, for a weight w [out, in] (or a stack [E, out, in] of expert weights, every field
with the leading E):
- `int8`: `data` int8 [out, in], `scale` float32 [out]: w = data * scale, symmetric per output row
  (scale = max |w_row| / 127).
- `int4`: `data` torch's CPU 4-bit layout of q in [0, 15] (`torch._convert_weight_to_int4pack_for_cpu`,
  [out, in / 2] uint8), `scale` [in / group, out, 2] holding (s, z) per group of `group` consecutive
  inputs of a row: w = (q - 8) * s + z (load-time quantization: q spans [min, max] of the group).
  `scale` is bfloat16, or float32 where a checkpoint's own scales and offsets are not exact in
  bfloat16 (worker_proc.loading.checkpoint_formats); the products then take float32 activations.
- `fp8`: e4m3 values with a float32 scale per output row ([out]) or per `group` x `group` block
  ([out / group, in / group], the last block of a row or column possibly partial): w = value * scale.
  On CUDA the values are float8_e4m3fn. On the CPU (no fast e4m3 product there) they are held as
  bfloat16: e4m3 values (exact in bfloat16), or, for a block-scaled checkpoint, values a per-row
  scale re-encodes exactly or a row dequantized to bfloat16 with scale 1 (worker_proc.loading.checkpoint_formats).

Products: x [M, in] -> [M, out] in x's dtype. `w8a16` runs torch's int8-weight kernel on bfloat16
activations; `w8a8` quantizes each row of x to int8 (symmetric, per row) and multiplies in int32,
exactly, so its rows never depend on the row count; `w4a16` runs torch's CPU 4-bit kernel on bfloat16
activations and scales (a checkpoint's float32 scales are rounded for it; its reference `dequant_int4`
reads them exactly); `fp8_bf16` is a bfloat16 product over the held values, scaled per output row
after it; `fp8_scaled` quantizes rows of x to e4m3 and runs `torch._scaled_mm`; `gemv_int8` and `gemv_w8a8`
are the fused few-row kernels over an int8 weight (the first with float32 activations, the second `w8a8`'s
arithmetic); `tiled_w8a8` is `w8a8`'s arithmetic over a tiled int8 copy (`Int8Tiles`, one more byte per
weight: an int8 matrix's values, or an int4 matrix's quantized per row to int8); `dequant` (any format,
any device) materialises the weight in x's dtype first: the reference every other product is tested against.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_proc.quant.layouts import (
    Int4Tiles,
    Int8Tiles,
    tile_int4,
    tile_int8,
    unpack_int4,
)

FORMATS = ("int8", "int4", "fp8")
INT8_MAX = 127.0
FP8_MAX = 448.0
INT4_GROUPS = (32, 64, 128)
"""The group sizes a 4-bit weight may use, the smallest dividing its input width first."""
INT4_OUT_MULTIPLE = 16
"""torch's CPU 4-bit layout needs the output width to be a multiple of this."""


QUANTIZED_COPIES = ("tiled", "tiled4")
"""The second copies a quantized matrix may hold for a product that reads them (`QuantizedWeight.with_copy`):
an int8 or int4 matrix's int8 values in oneDNN's packed layout or the tiled one of `tiled_w8a8`; an int4
matrix's own values in the tiled layout of `tiled_w4a8`."""
COPY_BYTES_PER_WEIGHT = {"tiled": 1.0, "tiled4": 0.5 + 4 / INT4_GROUPS[0]}
"""What each copy holds per weight: a byte, or four bits and (at the smallest group) a bfloat16 s and z per group."""


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """One quantized weight or expert stack (see the module doc for each format's fields)."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, int]  # (out, in) of one matrix
    group: int = 0  # int4: inputs per group; fp8: block side (0: one scale per row)
    tiled: Int8Tiles | None = None
    """int8 / int4 single matrices: the weight in the tiled int8 layout, likewise."""
    tiled4: Int4Tiles | None = None
    """int4 single matrices: the weight in the tiled 4-bit layout, likewise."""
    scale_bf16: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    """int8 / int4: `scale` in bfloat16, what the bfloat16-activation products take (made once, here)."""

    def __post_init__(self) -> None:
        if self.scale_bf16 is None and self.fmt in ("int8", "int4"):
            object.__setattr__(self, "scale_bf16", self.scale.to(torch.bfloat16))

    @property
    def experts(self) -> int:
        """Matrices in the stack (0: a single matrix)."""
        return self.data.shape[0] if self.data.dim() == 3 else 0

    @property
    def nbytes(self) -> int:
        extra = sum(c.nbytes for c in (self.tiled, self.tiled4) if c is not None)
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size() + extra

    def with_copy(self, kind: str) -> QuantizedWeight:
        """This matrix with its copy `kind` (one of `QUANTIZED_COPIES`) made. An int8 copy holds an int8 matrix's own
        values, or an int4 matrix's dequantized values (read with bfloat16 scales) quantized per row to int8 (each
        value moves by at most half an int8 step of its row); the tiled 4-bit copy an int4 matrix's own values."""
        if kind not in QUANTIZED_COPIES:
            raise ValueError(f"no quantized copy named {kind!r} (known: {', '.join(QUANTIZED_COPIES)})")
        if self.fmt not in ("int8", "int4") or self.experts:
            raise ValueError("only a single int8 or int4 matrix has a copy")
        if kind == "tiled4" and self.fmt != "int4":
            raise ValueError("only an int4 matrix has a tiled 4-bit copy")
        if getattr(self, kind) is not None:
            return self
        if kind == "tiled4":
            assert self.scale_bf16 is not None
            return dataclasses.replace(self, tiled4=tile_int4(int4_values(self), self.scale_bf16))
        data, scale = self._int8_values()
        return dataclasses.replace(self, tiled=tile_int8(data, scale))

    def _int8_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fmt == "int8":
            return self.data, self.scale
        values, scale = int4_values(self), self.scale_bf16
        assert scale is not None
        data = torch.empty(self.shape, dtype=torch.int8)
        row_scale = torch.empty(self.shape[0])
        for r0 in range(0, self.shape[0], DEQUANT_ROWS):
            rows = quantize_int8(int4_dequantized(values[r0 : r0 + DEQUANT_ROWS], scale[:, r0 : r0 + DEQUANT_ROWS]))
            data[r0 : r0 + DEQUANT_ROWS], row_scale[r0 : r0 + DEQUANT_ROWS] = rows.data, rows.scale
        return data, row_scale

    def __getitem__(self, expert: int) -> QuantizedWeight:
        """One matrix of a stack (views; nothing is copied)."""
        if not self.experts:
            raise IndexError("a single quantized matrix has no experts")
        low = self.scale_bf16[expert] if self.scale_bf16 is not None else None
        return QuantizedWeight(self.fmt, self.data[expert], self.scale[expert], self.shape, self.group,
                               scale_bf16=low)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] (one matrix) in `dtype`, computed in float32."""
        if self.experts:
            raise ValueError("dequantize one expert of a stack at a time")
        out, inp = self.shape
        if self.fmt == "int8":
            return (self.data.float() * self.scale[:, None]).to(dtype)
        if self.fmt == "int4":  # the product with the identity reads the opaque layout back
            eye = torch.eye(inp, dtype=self.scale.dtype, device=self.data.device)
            wt = torch._weight_int4pack_mm_for_cpu(eye, self.data, self.group, self.scale)
            return wt.t().to(dtype).contiguous()
        values = self.data.float()
        if self.group:
            b = self.group
            scale = self.scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:out, :inp]
            return (values * scale).to(dtype)
        return (values * self.scale[:, None]).to(dtype)

    def check_integrity(self) -> None:
        lead = self.data.shape[:-2] if self.fmt != "int4" or self.data.dim() == 3 else ()
        out, inp = self.shape
        if self.fmt == "int8":
            assert self.data.dtype == torch.int8 and tuple(self.data.shape[-2:]) == (out, inp)
            assert tuple(self.scale.shape) == (*lead, out) and self.scale.dtype == torch.float32
        elif self.fmt == "int4":
            assert self.group in INT4_GROUPS and inp % self.group == 0 and out % INT4_OUT_MULTIPLE == 0
            assert tuple(self.scale.shape[-3:]) == (inp // self.group, out, 2)
            assert self.scale.dtype in (torch.bfloat16, torch.float32)
        else:
            assert self.fmt == "fp8" and tuple(self.data.shape[-2:]) == (out, inp)
            assert bool(torch.isfinite(self.scale).all()) and bool((self.scale >= 0).all())


def int4_group(in_features: int, out_features: int) -> int:
    """The group size a weight of this shape gets in `int4` (0: the layout cannot hold it)."""
    if out_features % INT4_OUT_MULTIPLE:
        return 0
    return next((g for g in INT4_GROUPS if in_features % g == 0), 0)


def row_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| of each row of w [..., out, in] (float32)."""
    return w.float().abs().amax(-1)


DEQUANT_ROWS = 4096
"""Rows of a 4-bit matrix dequantized at a time for its int8 copy and its layout check (a large LM head's float32
values whole would be gigabytes)."""


def int4_dequantized(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w = (q - 8) s + z in float32 for values q [out, in] and their (s, z) per group `scale` [in / group, out, 2]."""
    group = values.shape[1] // scale.shape[0]
    s, z = (scale[..., i].t().float().repeat_interleave(group, dim=1) for i in (0, 1))
    return (values.float() - 8.0) * s + z


def int4_values(q: QuantizedWeight) -> torch.Tensor:
    """The 4-bit values [out, in] (uint8, 0-15) of a single int4 matrix (`unpack_int4`), checked against torch's own
    4-bit kernel on two rows of x: a torch whose layout differs fails here, not in a wrong product later."""
    values = unpack_int4(q.data, *q.shape)
    assert q.scale_bf16 is not None
    x = torch.randn(2, q.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expected = torch._weight_int4pack_mm_for_cpu(x, q.data, q.group, q.scale_bf16).float()
    scale, rows = q.scale_bf16, DEQUANT_ROWS
    read = torch.cat([x.float() @ int4_dequantized(values[r0 : r0 + rows], scale[:, r0 : r0 + rows]).t()
                      for r0 in range(0, q.shape[0], rows)], dim=1)
    if not torch.allclose(read, expected, rtol=0.02, atol=0.02 * float(expected.abs().max())):
        raise RuntimeError(f"torch {torch.__version__}'s CPU 4-bit layout is not the one worker_proc.quant.weight "
                           "reads (unpack_int4)")
    return values


def quantize_int8(w: torch.Tensor, amax: torch.Tensor | None = None) -> QuantizedWeight:
    """Symmetric per-row int8 of w [..., out, in]; `amax`: each row's max |w| over the whole row when w
    holds only a slice of it (a row-parallel shard), else its own."""
    wf = w.float()
    scale = (row_amax(w) if amax is None else amax) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    data = torch.round(wf / safe[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return QuantizedWeight("int8", data, scale.contiguous(), (w.shape[-2], w.shape[-1]))


def _int4_matrix(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    wg = w.float().view(out, inp // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = (hi - lo) / 15.0
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((wg - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.int32).view(out, inp)
    data = torch._convert_weight_to_int4pack_for_cpu(q, 2)
    scale = torch.stack((s, lo + 8.0 * s), -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return data, scale


def quantize_int4(w: torch.Tensor, group: int) -> QuantizedWeight:
    """Asymmetric group-wise 4-bit of w [..., out, in] in torch's CPU layout."""
    if w.dim() == 3:
        parts = [_int4_matrix(m, group) for m in w]
        data, scale = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    else:
        data, scale = _int4_matrix(w, group)
    return QuantizedWeight("int4", data, scale, (w.shape[-2], w.shape[-1]), group)


def fp8_values(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """e4m3 values as a product on `device` reads them (see the module doc)."""
    e4m3 = values.to(torch.float8_e4m3fn)
    return e4m3 if device.type == "cuda" else e4m3.to(torch.bfloat16)


def quantize_fp8(w: torch.Tensor, amax: torch.Tensor | None = None) -> QuantizedWeight:
    """e4m3 with one float32 scale per output row, of w [..., out, in] (`amax` as in quantize_int8)."""
    wf = w.float()
    scale = (row_amax(w) if amax is None else amax) / FP8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return QuantizedWeight("fp8", fp8_values(wf / safe[..., None], w.device), scale.contiguous(),
                           (w.shape[-2], w.shape[-1]))


def _bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias


def w8a16(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch._weight_int8pack_mm(x.to(torch.bfloat16), q.data, q.scale_bf16)
    return _bias(out.to(x.dtype), bias)


CUDA_INT_MM_MIN_ROWS = 17
"""cuBLAS' int8 product (torch._int_mm on CUDA) takes more than 16 rows."""
CUDA_FP8_ROW_MULTIPLE = 16
"""torch._scaled_mm on CUDA takes a row count that is a multiple of 16."""


def gemv_int8(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """An int8 weight streamed by the fused few-row product (worker_proc/kernels/native/gemv_ops.cpp): each
    weight row read once for up to eight rows of x, its int8 values widened to float32 in registers, the dot
    product in float32 times the row's scale; the result in x's dtype."""
    return torch.ops.hyssm_cpu.gemv_int8(x, q.data, q.scale, bias)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] >= rows else torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows as int8 with a float32 scale each [M, 1] (symmetric, max |row| / 127; a zero row's scale 1): the
    activations of the w8a8 products."""
    xf = x.float()
    xs = xf.abs().amax(-1, keepdim=True) / INT8_MAX
    xs = torch.where(xs > 0, xs, torch.ones_like(xs))
    return torch.round(xf / xs).to(torch.int8), xs


def w8a8(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    xq, xs = quantize_rows(x)
    if x.is_cuda:
        xq = _pad_rows(xq, CUDA_INT_MM_MIN_ROWS)
    acc = torch._int_mm(xq, q.data.t())[:rows]
    return _bias((acc.float() * (xs * q.scale)).to(x.dtype), bias)


def gemv_w8a8(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`w8a8`'s arithmetic, to the bit, in the fused few-row kernel (worker_proc/kernels/native/w8a8_ops.cpp:
    x's rows quantized as `quantize_rows` does, exact int32 sums, 64 byte pairs an instruction where the CPU
    has AVX512-VNNI, each weight row read once for up to eight rows). x float32 or bfloat16, unit-stride rows."""
    rows = x if x.stride(-1) == 1 else x.contiguous()
    return _bias(torch.ops.hyssm_cpu.gemv_w8a8(rows, q.data, q.scale).to(x.dtype), bias)


def tiled_w8a8(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`w8a8`'s arithmetic, to the bit, over the matrix's tiled int8 copy (`with_copy("tiled")`; an int4 matrix's
    copy holds its values quantized per row to int8) in the fused batched-decode kernel: each block of 16 weight
    rows read once for up to eight rows of x, no sum reduced across lanes."""
    copy = q.tiled
    assert copy is not None, "tiled_w8a8 needs the tiled copy (QuantizedWeight.with_copy)"
    rows = x if x.stride(-1) == 1 else x.contiguous()
    return _bias(torch.ops.hyssm_cpu.tiled_w8a8(rows, copy.data, copy.row_sums, copy.scale).to(x.dtype), bias)


def tiled_w4a8(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Rows of x quantized to int8 (as `w8a8`) times the 4-bit values in int32 per group, each group's sum scaled
    by its s and offset by its z in float32 (w4a8_ops.cpp), over the matrix's tiled 4-bit copy
    (`with_copy("tiled4")`): half the bytes of the int8 copies, each block of 16 rows read once for up to eight
    rows of x. Each row's result depends on that row only."""
    copy = q.tiled4
    assert copy is not None, "tiled_w4a8 needs the tiled 4-bit copy (QuantizedWeight.with_copy)"
    rows = x if x.stride(-1) == 1 else x.contiguous()
    return _bias(torch.ops.hyssm_cpu.tiled_w4a8(rows, copy.data, copy.scales, copy.out_features).to(x.dtype), bias)


def w4a16(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    # float32 activations take torch's scalar 4-bit path, many times slower than the bfloat16 one; the kernel
    # refuses rows that are not contiguous (a bfloat16 view of a wider tensor)
    out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), q.data, q.group, q.scale_bf16)
    return _bias(out.to(x.dtype), bias)


def fp8_bf16(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    out = F.linear(x.to(torch.bfloat16), q.data).float() * q.scale
    return _bias(out.to(x.dtype), bias)


def fp8_scaled(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Row-wise scaled e4m3 product (on CUDA: bfloat16 out, rows padded to a multiple of 16)."""
    rows = x.shape[0]
    xf = x.float()
    xs = xf.abs().amax(-1, keepdim=True) / FP8_MAX
    xs = torch.where(xs > 0, xs, torch.ones_like(xs))
    xq = (xf / xs).to(torch.float8_e4m3fn)
    out_dtype = torch.float32
    if x.is_cuda:
        padded = -(-rows // CUDA_FP8_ROW_MULTIPLE) * CUDA_FP8_ROW_MULTIPLE
        xq, xs, out_dtype = _pad_rows(xq, padded), _pad_rows(xs, padded), torch.bfloat16
    out = torch._scaled_mm(xq, q.data.t(), scale_a=xs.contiguous(), scale_b=q.scale[None, :].float().contiguous(),
                           out_dtype=out_dtype)[:rows]  # fmt: skip
    return _bias(out.to(x.dtype), bias)


def dequant(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, q.dequantize(x.dtype), bias)
