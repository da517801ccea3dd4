"""The conversions of one quantized checkpoint module's tensors to the weight a rank holds (a `QuantizedWeight`,
or the dequantized dense matrix where the module's site cannot hold the format), which the scheme's method
(worker_proc.loading.stored_methods) runs.

For every module the checkpoint stores quantized (worker_proc.loading.prequantized) each rank reads
only its slice (`Part`: whole shape and the ShardSpec of its rows or columns) of the values and of
the scales, zero points and packed words covering it. The conversions:
- compressed-tensors int8 (`weight` int8, `weight_scale` [out, 1] or [1]): `int8` as stored, the
  scale as float32 per row (exact);
- e4m3 with per-channel or per-tensor scales: `fp8` per row as stored (exact; on the CPU the values
  in bfloat16, exact);
- e4m3 with block scales (`weight_scale_inv` / `weight_scale` [ceil(out/B0), ceil(in/B1)]): on CUDA
  the e4m3 values and the block scales as they are (square blocks only; the accelerator plan runs
  them through `dequant_fp8`, which materialises the weight per product: correct, not fast, and not
  run on a GPU by this project's tests). On the CPU, which has no e4m3 product and where a
  block-scaled weight's only product would be that per-product dequantization (many times slower
  than the bfloat16 product), each row is re-encoded to the per-row form: values times
  block scale / row scale where that is exact (block scales of a row equal, or powers of two apart,
  e.g. UE8M0 checkpoints), else the row dequantized to bfloat16 with row scale 1 (what a bfloat16
  model dequantizing the checkpoint holds, within 2^-9 relative of the float32 dequantization; the
  fp8 rounding itself is 2^-4). Both run `fp8_bf16`, the CPU's fastest product over these values, at
  the bytes of a bfloat16 weight. Any TP slice works on the CPU (the scales are gathered per
  element); on CUDA a slice must not cut a block;
- compressed-tensors 4-bit (`weight_packed` int32, 8 nibbles q + 8 per word along the input,
  `weight_scale` [out, groups], optional `weight_zero_point` packed 8 per word along the output):
  compressed-tensors dequantizes w = (q - zp) * s with q, zp in [-8, 7]; the CPU layout's nibble is
  q + 8 and its offset z = -zp * s, so w = (nibble - 8) * s + z exactly. Its group is the largest
  layout group (32, 64, 128) dividing the checkpoint's group (the input width for per-channel
  scales) and the rank's column ranges; each layout group repeats its checkpoint group's (s, z).
  (s, z) are held in bfloat16 when every one is exact there, else in float32.
A weight whose site cannot hold its format (a router, a 4-bit weight whose output width is not a
multiple of 16 or whose width no layout group divides) is dequantized to float32 and loaded dense.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.errors import ModelLoadError
from worker_proc.loading.checkpoint_config import StoredScheme
from worker_proc.model.shard import Range, ShardSpec
from worker_proc.quant.weight import INT4_GROUPS, QuantizedWeight

ROW_CHUNK = 512
"""Rows converted at a time (bounds the float32 temporaries of a block-scaled conversion)."""
WORD_NIBBLES = 8

Read = Callable[[str, int, tuple[Range, ...] | None], torch.Tensor]
"""(tensor name, dim, ranges along it or None for the whole tensor) -> the tensor's part."""


@dataclass(frozen=True)
class Part:
    """A rank's part of one [out, in] matrix: `spec` None (all of it) or ranges of its rows (dim 0)
    or columns (dim 1)."""

    shape: tuple[int, int]
    spec: ShardSpec | None = None

    def __post_init__(self) -> None:
        if self.spec is not None and self.spec.dim not in (0, 1):
            raise ValueError(f"a matrix is split on dim 0 or 1, not {self.spec.dim}")

    def ranges(self, dim: int) -> tuple[Range, ...]:
        if self.spec is not None and self.spec.dim == dim:
            return self.spec.ranges
        return ((0, self.shape[dim]),)

    @property
    def local(self) -> tuple[int, int]:
        return (sum(b - a for a, b in self.ranges(0)), sum(b - a for a, b in self.ranges(1)))


def covering(ranges: tuple[Range, ...], unit: int) -> tuple[tuple[Range, ...], torch.Tensor]:
    """The ranges of `unit`-sized pieces (blocks, groups, packed words) covering `ranges`, and each
    covered element's position in the concatenation of those pieces expanded (piece = pos // unit)."""
    pieces, pos, base = [], [], 0
    for a, b in ranges:
        pa, pb = a // unit, -(-b // unit)
        pieces.append((pa, pb))
        pos.append(torch.arange(a, b) - pa * unit + base * unit)
        base += pb - pa
    return tuple(pieces), torch.cat(pos)


def scheme_group(scheme: StoredScheme, part: Part) -> int:
    return scheme.group or part.shape[1]


def int4_layout_group(scheme: StoredScheme, part: Part) -> int:
    """The largest CPU-layout group dividing the checkpoint's group and every column range (0: none)."""
    group = scheme_group(scheme, part)
    edges = [x for r in part.ranges(1) for x in (r[0], r[1] - r[0])]
    return next((g for g in sorted(INT4_GROUPS, reverse=True) if group % g == 0 and all(e % g == 0 for e in edges)),
                0)


def matrix_values(read: Read, prefix: str, part: Part, want: torch.dtype, scheme: StoredScheme) -> torch.Tensor:
    """The part of module `prefix`'s `weight` (int8 or e4m3 values), checked to be stored as `want`."""
    values = _rows(read, f"{prefix}.weight", part) if part.spec is None or part.spec.dim == 0 else \
        read(f"{prefix}.weight", 1, part.spec.ranges)
    if values.dtype != want:
        raise ModelLoadError(f"{prefix}.weight is {values.dtype}, expected {want} for {scheme.describe()}")
    return values


def row_scale(read: Read, key: str, part: Part) -> torch.Tensor:
    """A per-channel ([out, 1] / [out]) or per-tensor ([1] / []) scale as float32 [local out]."""
    whole = read(key, 0, None)
    if whole.numel() == 1:
        return whole.float().reshape(1).expand(part.local[0]).contiguous()
    if whole.numel() != part.shape[0]:
        raise ModelLoadError(f"{key} has {whole.numel()} scales for {part.shape[0]} rows")
    rows = whole.float().reshape(-1)
    return torch.cat([rows[a:b] for a, b in part.ranges(0)])


def _block_scales(read: Read, key: str, scheme: StoredScheme, part: Part) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """The block scales covering the part (float32) and each local row's / column's index into them."""
    bo, bi = scheme.block
    grid = (math.ceil(part.shape[0] / bo), math.ceil(part.shape[1] / bi))
    row_pieces, row_pos = covering(part.ranges(0), bo)
    col_pieces, col_pos = covering(part.ranges(1), bi)
    split = part.spec.dim if part.spec is not None else 0
    pieces = row_pieces if split == 0 else col_pieces
    scales = read(key, split, pieces).float()
    other = scales.shape[1 - split]
    if other != grid[1 - split]:
        raise ModelLoadError(f"{key} has a {tuple(scales.shape)} scale grid for a {part.shape} weight in {bo}x{bi} "
                             f"blocks (expected {grid})")
    return scales, row_pos // bo, col_pos // bi


def block_fp8(read: Read, prefix: str, scheme: StoredScheme, part: Part, values: torch.Tensor,
               device: torch.device, dense: bool) -> QuantizedWeight | torch.Tensor:
    scales, row_block, col_block = _block_scales(read, f"{prefix}.{scheme.scale_name}", scheme, part)
    if device.type != "cpu" and not dense:
        return QuantizedWeight("fp8", values.to(torch.float8_e4m3fn).to(device), scales.contiguous().to(device),
                               part.local, scheme.block[0])
    data, row_scale = [], []
    for start in range(0, values.shape[0], ROW_CHUNK):
        v = values[start:start + ROW_CHUNK].float()
        s = scales.index_select(0, row_block[start:start + ROW_CHUNK]).index_select(1, col_block)
        exact = v * s
        if dense:
            data.append(exact)
            continue
        rows, scale = per_row_fp8(v, s, exact)
        data.append(rows)
        row_scale.append(scale)
    if dense:
        return torch.cat(data)
    return QuantizedWeight("fp8", torch.cat(data), torch.cat(row_scale), part.local)


def per_row_fp8(values: torch.Tensor, scales: torch.Tensor, exact: torch.Tensor) -> tuple[torch.Tensor,
                                                                                        torch.Tensor]:
    """Rows of e4m3 `values` with per-element `scales` ([r, in] float32; `exact` = their product) as
    (bfloat16 data [r, in], float32 row scale [r]): values * scale / row max where that times the row
    max gives `exact` back bit for bit, else the row `exact` in bfloat16 with scale 1."""
    top = scales.amax(1)
    top = torch.where(top > 0, top, torch.ones_like(top))
    encoded = (values * (scales / top[:, None])).to(torch.bfloat16)
    same = (encoded.float() * top[:, None] == exact).all(1)
    data = torch.where(same[:, None], encoded, exact.to(torch.bfloat16))
    return data, torch.where(same, top, torch.ones_like(top))


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, w] holding 8 4-bit values each, element i at bits 4 (i % 8) of word i // 8 ->
    uint8 [rows, 8 w] (compressed-tensors' packing)."""
    if sys.byteorder != "little":
        raise ModelLoadError("4-bit packed checkpoints are read on little-endian hosts only")
    raw = words.reshape(-1).view(torch.uint8)
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(words.shape[0], -1)


def int4_parts(read: Read, prefix: str, scheme: StoredScheme, part: Part) -> tuple[torch.Tensor, ...]:
    """(nibbles q + 8 uint8 [out, in], s and zp float32 [out, covering groups], each local column's
    index into those groups) of the part: only the packed words, scales and zero points covering it."""
    shape = [int(x) for x in read(f"{prefix}.weight_shape", 0, None).tolist()]
    if shape != list(part.shape):
        raise ModelLoadError(f"{prefix}.weight_shape is {shape}, expected {list(part.shape)}")
    group = scheme_group(scheme, part)
    by_cols = part.spec is not None and part.spec.dim == 1
    col_words, col_pos = covering(part.ranges(1), WORD_NIBBLES)
    words = read(f"{prefix}.weight_packed", 1, col_words) if by_cols else _rows(read, f"{prefix}.weight_packed", part)
    q = unpack_nibbles(words).index_select(1, col_pos)
    col_groups, group_pos = covering(part.ranges(1), group)
    key = f"{prefix}.{scheme.scale_name}"
    scale = (read(key, 1, col_groups) if by_cols else _rows(read, key, part)).float()
    if scheme.symmetric:
        return q, scale, torch.zeros_like(scale), group_pos // group
    row_words, row_pos = covering(part.ranges(0), WORD_NIBBLES)
    key = f"{prefix}.weight_zero_point"
    packed = read(key, 1, col_groups) if by_cols else read(key, 0, row_words)
    zp = unpack_nibbles(packed.t().contiguous()).t()
    zp = zp[: part.shape[0]] if by_cols else zp.index_select(0, row_pos)
    return q, scale, zp.float() - 8.0, group_pos // group


def _rows(read: Read, key: str, part: Part) -> torch.Tensor:
    return read(key, 0, None if part.spec is None else part.spec.ranges)


def int4_weight(parts: tuple[torch.Tensor, ...], scheme: StoredScheme, part: Part) -> QuantizedWeight:
    """The CPU 4-bit layout of the part (see the module doc); (s, z) in float32 here (`narrow_int4`)."""
    q, scale, zp, group_index = parts
    group = int4_layout_group(scheme, part)
    out, inp = part.local
    first = group_index[torch.arange(0, inp, group)]  # each layout group's checkpoint group
    s, z = scale[:, first], -zp[:, first] * scale[:, first]
    data = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    return QuantizedWeight("int4", data, torch.stack((s, z), -1).transpose(0, 1).contiguous(), (out, inp), group)


def int4_dequantized(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    q, scale, zp, group_index = parts
    return (q.float() - 8.0 - zp[:, group_index]) * scale[:, group_index]


def narrow_int4(q: QuantizedWeight) -> QuantizedWeight:
    """`q` with its (s, z) in bfloat16 when every one is exact there (the faster product)."""
    narrow = q.scale.to(torch.bfloat16)
    if not torch.equal(narrow.float(), q.scale):
        return q
    return QuantizedWeight(q.fmt, q.data, narrow, q.shape, q.group)


def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Experts' matrices of one format and shape as one [E, ...] stack."""
    first = parts[0]
    if any(p.fmt != first.fmt or p.shape != first.shape or p.group != first.group for p in parts):
        raise ModelLoadError("the experts of one stack are stored in different formats")
    scale_dtype = torch.float32 if any(p.scale.dtype == torch.float32 for p in parts) else first.scale.dtype
    return QuantizedWeight(first.fmt, torch.stack([p.data for p in parts]),
                           torch.stack([p.scale.to(scale_dtype) for p in parts]), first.shape, first.group)
