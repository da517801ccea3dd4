"""The layouts of a quantized matrix's second copies (`QuantizedWeight.with_copy`, worker_proc.quant.weight):
the tiled int8 layout of `tiled_w8a8` (`Int8Tiles`) and the tiled
4-bit layout of `tiled_w4a8` (`Int4Tiles`), each with the function that makes it; and the reading of torch's
CPU 4-bit layout (`unpack_int4`), which the 4-bit copies start from. A tiled copy large enough lies on huge
pages (`host_memory.weight_tensor`): a step of few rows streams it whole."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_proc.host.memory import weight_tensor
from worker_proc.kernels.native.layout import INT4_CHUNK, INT8_TILE_COLUMNS, TILE_ROWS


@dataclass(frozen=True, eq=False)
class Int8Tiles:
    """An int8 matrix [out, in] in the layout of the fused batched-decode product `tiled_w8a8`
    (worker_proc/kernels/native/w8a8_ops.cpp): `data` [ceil(out / 16), in / 4, 16, 4] (blocks of 16 output
    rows, four input columns of a row side by side, rows past `out` zero), `row_sums` int32 [ceil(out / 16) * 16]
    (each row's sum of values), `scale` float32 [out]: w = value * scale per output row."""

    data: torch.Tensor
    row_sums: torch.Tensor
    scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.row_sums.numel() * 4


def tile_int8(data: torch.Tensor, scale: torch.Tensor) -> Int8Tiles:
    """The tiled copy of an int8 matrix `data` [out, in] (in a multiple of 4) with row scales `scale` [out], on
    huge pages where it is large enough (a step of few rows streams it whole)."""
    out, inp = data.shape
    blocks = -(-out // TILE_ROWS)
    rows = F.pad(data, (0, 0, 0, blocks * TILE_ROWS - out))
    buffer = weight_tensor((blocks, inp // INT8_TILE_COLUMNS, TILE_ROWS, INT8_TILE_COLUMNS), torch.int8)
    buffer.copy_(rows.view(blocks, TILE_ROWS, inp // INT8_TILE_COLUMNS, INT8_TILE_COLUMNS).transpose(1, 2))
    return Int8Tiles(buffer, rows.sum(1, dtype=torch.int32), scale.float().contiguous())




@dataclass(frozen=True, eq=False)
class Int4Tiles:
    """A 4-bit matrix [out, in] in the layout of `tiled_w4a8` (worker_proc/kernels/native/w4a8_ops.cpp): `data`
    uint8 [ceil(out / 16), in / 8, 16, 4] (blocks of 16 output rows; byte i of a row in chunk c holds inputs
    8c + i in its low nibble and 8c + 4 + i in its high one; rows past `out_features` zero), `scales` bfloat16
    [ceil(out / 16), in / group, 2, 16] (per block and group, the 16 rows' s, then their z: w = (q - 8) s + z)."""

    data: torch.Tensor
    scales: torch.Tensor
    out_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * 2


def unpack_int4(data: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """The values q [out, in] (uint8, 0-15) of a matrix in torch's CPU 4-bit layout: blocks of 64 output rows, each
    input's 32 bytes holding rows j (low nibble) and j + 32 (high) of its block, then the last out % 64 rows
    with each input's bytes holding rows 2j and 2j + 1. `int4_values` checks the reading against torch's kernel."""
    flat = data.reshape(-1)
    full = out // 64 * 64
    q = torch.empty(out, inp, dtype=torch.uint8, device=data.device)
    if full:
        blocks = flat[: full * inp // 2].view(out // 64, inp, 32)
        q[:full] = torch.cat([blocks & 15, blocks >> 4], dim=2).permute(0, 2, 1).reshape(full, inp)
    if out > full:
        tail = flat[full * inp // 2 :].view(inp, (out - full) // 2)
        q[full:] = torch.stack([tail & 15, tail >> 4], dim=2).reshape(inp, out - full).t()
    return q


def tile_int4(values: torch.Tensor, scale_bf16: torch.Tensor) -> Int4Tiles:
    """The tiled 4-bit copy of values q [out, in] (uint8, 0-15; in a multiple of 8) with their (s, z) per group
    `scale_bf16` [in / group, out, 2], on huge pages where it is large enough (a step of few rows streams it)."""
    out, inp = values.shape
    blocks = -(-out // TILE_ROWS)
    padded = F.pad(values, (0, 0, 0, blocks * TILE_ROWS - out))
    q = padded.view(blocks, TILE_ROWS, inp // INT4_CHUNK, 2, 4)
    data = weight_tensor((blocks, inp // INT4_CHUNK, TILE_ROWS, 4), torch.uint8)
    data.copy_((q[:, :, :, 0] | (q[:, :, :, 1] << 4)).transpose(1, 2))
    groups = scale_bf16.shape[0]
    padded = F.pad(scale_bf16, (0, 0, 0, blocks * TILE_ROWS - out))
    scales = padded.view(groups, blocks, TILE_ROWS, 2).permute(1, 0, 3, 2).contiguous()
    return Int4Tiles(data, scales, out)
