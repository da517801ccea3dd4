"""`VisionTower`: Qwen3.5's vision encoder (`HybridConfig.vision`, checkpoint tensors `visual.*` after the
family's renames), images' pixels -> the embeddings that take the place of their placeholder tokens.

One call encodes every image a step needs (worker_proc.model.encoder_cache decides which): the linear
layers run over every patch of every image at once, attention over each frame's own patches only
(non-causal, one call per frame). Per image of patch grid (t, h, w):
- patch embedding: the checkpoint's Conv3d has kernel == stride, so it is one linear map over each
  flattened patch (a row of `pixel_values`: channel, time, row, column);
- plus the learned square position table resampled bilinearly to the (h, w) grid (corner-aligned);
- `depth` blocks: x += proj(attention(rope(qkv(LayerNorm(x))))), x += fc2(act(fc1(LayerNorm(x)))), the
  rotary embedding 2D axial: the first half of each head's rotary frequencies turn with the patch's row,
  the second with its column;
- the merger: LayerNorm, then each `spatial_merge_size`^2 consecutive patches (the processor emits
  patches in merge-block order) concatenated, fc1, GELU, fc2 -> one token of the text model's width.
Products are plain `F.linear` in the model dtype: the tower runs once per image, so the text model's
execution plan does not cover it and `--quantization` does not quantize it. Under tensor parallelism the
tower is replicated: every rank loads it whole and runs it on the same images, with no communication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shared.model_config import VisionConfig
from worker_proc.model.layers import empty_param

LAYER_NORM_EPS = 1e-6

_ACTS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class _Affine(nn.Module):
    """Weight and bias of one product (`weight` [out, *in]: a Conv3d's shape is kept as the checkpoint has it)."""

    def __init__(self, out: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = empty_param(out, *shape, dtype=dtype, device=device)
        self.bias = empty_param(out, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.view(self.weight.shape[0], -1), self.bias)


class _LayerNorm(_Affine):
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(size, (), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, LAYER_NORM_EPS)


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = _Affine(3 * cfg.hidden_size, (cfg.hidden_size,), dtype, device)
        self.proj = _Affine(cfg.hidden_size, (cfg.hidden_size,), dtype, device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], frames: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        outs, at = [], 0
        for length in frames:  # each frame attends over its own patches only
            part = [t[at : at + length].transpose(0, 1) for t in (q, k, v)]
            outs.append(F.scaled_dot_product_attention(*part).transpose(0, 1))
            at += length
        return self.proj(torch.cat(outs).reshape(n, -1))


class _Block(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm1 = _LayerNorm(cfg.hidden_size, dtype, device)
        self.norm2 = _LayerNorm(cfg.hidden_size, dtype, device)
        self.attn = _Attention(cfg, dtype, device)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = _Affine(cfg.intermediate_size, (cfg.hidden_size,), dtype, device)
        self.mlp.linear_fc2 = _Affine(cfg.hidden_size, (cfg.intermediate_size,), dtype, device)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], frames: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, frames)
        return x + self.mlp.linear_fc2(self.act(self.mlp.linear_fc1(self.norm2(x))))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d] rotated in float32 by the tables [N, 1, d], back in x's dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    turned = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + turned * sin).to(x.dtype)


def _merge_order(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """A per-patch [h, w, ...] grid in the processor's patch order: merge blocks row-major, and within a
    block its `merge` x `merge` patches row-major."""
    h, w = grid.shape[:2]
    blocks = grid.reshape(h // merge, merge, w // merge, merge, *grid.shape[2:]).transpose(1, 2)
    return blocks.reshape(h * w, *grid.shape[2:])


def _bilinear(size: int, side: int, device: torch.device) -> torch.Tensor:
    """[size, side] float32 weights resampling `side` table entries to `size` corner-aligned points."""
    src = torch.arange(size, dtype=torch.float32, device=device) * (side - 1) / max(size - 1, 1)
    low = src.floor().long().clamp(max=side - 1)
    frac = src - low
    points = torch.arange(size, device=device)
    out = torch.zeros(size, side, device=device)
    out[points, low] = 1 - frac
    out[points, (low + 1).clamp(max=side - 1)] += frac
    return out


class VisionTower(nn.Module):
    """The tower of `cfg` (see the module doc); parameters named as the checkpoint's `visual.*`."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        hidden, merged = cfg.hidden_size, cfg.hidden_size * cfg.spatial_merge_size**2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = _Affine(hidden, (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                                 cfg.patch_size), dtype, device)
        self.pos_embed = nn.Module()
        self.pos_embed.weight = empty_param(cfg.num_position_embeddings, hidden, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(_Block(cfg, dtype, device) for _ in range(cfg.depth))
        self.merger = nn.Module()
        self.merger.norm = _LayerNorm(hidden, dtype, device)
        self.merger.linear_fc1 = _Affine(merged, (merged,), dtype, device)
        self.merger.linear_fc2 = _Affine(cfg.out_hidden_size, (merged,), dtype, device)

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """The merged tokens of an image of patch grid `grid`."""
        t, h, w = grid
        return t * h * w // self.cfg.spatial_merge_size**2

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """pixels: float32 [sum of t * h * w, patch_dim], the images' patches one image after another;
        returns [sum of tokens(grid), out_hidden_size] in the model dtype, the images' tokens in order."""
        cfg = self.cfg
        if pixels.shape != (sum(math.prod(g) for g in grids), cfg.patch_dim):
            raise ValueError(f"pixels {tuple(pixels.shape)} for grids {list(grids)} of {cfg.patch_dim} values a patch")
        x = self.patch_embed.proj(pixels.to(self.dtype))
        x = x + self._positions(grids).to(x.dtype)
        rope = self._rope(grids, x.device)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, rope, frames)
        x = self.merger.norm(x).reshape(-1, cfg.hidden_size * cfg.spatial_merge_size**2)
        return self.merger.linear_fc2(F.gelu(self.merger.linear_fc1(x)))

    def _positions(self, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """The learned position table resampled to every image's grid, float32, in patch order."""
        side = math.isqrt(self.cfg.num_position_embeddings)
        table = self.pos_embed.weight.float().view(side, side, -1)
        parts = []
        for t, h, w in grids:
            grid = torch.einsum("hi,wj,ijc->hwc", _bilinear(h, side, table.device), _bilinear(w, side, table.device),
                                table)
            parts.append(_merge_order(grid, self.cfg.spatial_merge_size).repeat(t, 1))
        return torch.cat(parts)

    def _rope(self, grids: Sequence[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (cos, sin) [patches, 1, head_dim]: a quarter of the head's frequencies at the patch's row,
        the next quarter at its column, the whole repeated for the rotated half (angles float32, as the
        checkpoint's reference computes them; cos and sin in float64)."""
        cfg = self.cfg
        spatial = cfg.hidden_size // cfg.num_heads // 2  # channels of one axis' rotation
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
        parts = []
        for t, h, w in grids:
            rows = torch.arange(h)[:, None].expand(h, w)
            cols = torch.arange(w)[None, :].expand(h, w)
            parts.append(_merge_order(torch.stack([rows, cols], dim=-1), self.cfg.spatial_merge_size).repeat(t, 1))
        pos = torch.cat(parts).float()  # [patches, 2]: row, column
        angles = (pos[:, :, None] * inv_freq).reshape(pos.shape[0], -1).double()
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().float().to(device)[:, None, :], emb.sin().float().to(device)[:, None, :]
