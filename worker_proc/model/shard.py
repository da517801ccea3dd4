"""`TPInfo` (a rank's place in the tensor-parallel group) and `ShardSpec` (the slice of a checkpoint
tensor a rank holds). Dependency-free of the model modules so that every block can name its slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

Range = tuple[int, int]


@dataclass(frozen=True)
class TPInfo:
    """This rank's place in the tensor-parallel group (group = a torch.distributed group or None)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (no-op for one rank); returns `x`."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast_first(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` becomes the first rank's, in place (no-op for one rank); returns `x`."""
        if self.size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                           group=self.group)
        return x


@dataclass(frozen=True)
class ShardSpec:
    """The part of a checkpoint tensor a rank holds: the listed index ranges along `dim`,
    concatenated in order."""

    dim: int
    ranges: tuple[Range, ...]

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor.narrow(self.dim, a, b - a) for a, b in self.ranges], dim=self.dim)

    @property
    def length(self) -> int:
        return sum(b - a for a, b in self.ranges)


def column_spec(tp: TPInfo, sub: str, inner: int, columns: tuple[str, ...], rows: tuple[str, ...],
                lead: int = 0) -> ShardSpec | None:
    """An MLP of this rank's width `inner`: the tensors named in `columns` ([.., inner * N, in]) are
    split on their output rows, those in `rows` ([.., out, inner * N]) on their input columns; `lead`
    = 1 for stacked expert weights [E, ...]. Any other tensor is replicated (None)."""
    if tp.size == 1:
        return None
    own = ((tp.rank * inner, (tp.rank + 1) * inner),)
    if sub in columns:
        return ShardSpec(lead, own)
    if sub in rows:
        return ShardSpec(lead + 1, own)
    return None
