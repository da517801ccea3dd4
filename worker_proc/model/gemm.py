"""Matrix products of a worker's model: the methods a product can run with, and `GemmSite`, the one
object each product of a module goes through.

Which method a site runs at which row count is the execution plan's decision
(worker_proc.execution_plan binds every site once, after the weights are loaded); a site only holds
the storages its methods read and picks the method by the input's row count. Storages: `dense` (the
module's own [out, in] tensor, passed in on each call) and `packed` (oneDNN's layout, held by the
site). A site that was never bound runs `DENSE` (F.linear) at every row count.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MIN_GEMM_ROWS = 16
"""Row count below which CPU BLAS switches to kernels whose rounding depends on the row count;
padding small inputs up to it makes every row's result independent of what it is batched with."""

PACK_ROWS = 8
"""The row count oneDNN lays a packed weight out for (a layout hint; every row count is served)."""


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
class GemmMethod:
    """One way to compute x @ weight.T. `storage`: which copy of the weight it reads; `batch_invariant`:
    each row's result does not depend on the row count."""

    name: str
    storage: str
    batch_invariant: bool = False

    def supports(self, dtype: torch.dtype, device: torch.device, packable: bool) -> bool:
        if device.type != "cpu":
            return self.name == "dense"
        if self.name == "split":
            return dtype == torch.float32
        if self.name == "packed":
            return packable and packing_supported(dtype, device)
        return True

    def apply(self, x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
        if self.name == "dense":
            return F.linear(x, weight, bias)
        if self.name == "packed":
            assert packed is not None, "a packed method on a site without a packed weight"
            return packed_product(x, packed, bias)
        if self.name == "split":
            out = split_gemm(x, weight, gemm_parts(weight.shape[0]))
            return out if bias is None else out + bias
        rows = x.shape[0]  # padded
        if rows >= MIN_GEMM_ROWS:
            return F.linear(x, weight, bias)
        padded = torch.cat([x, x.new_zeros(MIN_GEMM_ROWS - rows, x.shape[1])])
        return F.linear(padded, weight, bias)[:rows]


DENSE = GemmMethod("dense", "dense")
SPLIT = GemmMethod("split", "dense")
PACKED = GemmMethod("packed", "packed")
PADDED = GemmMethod("padded", "dense", batch_invariant=True)
METHODS = {m.name: m for m in (DENSE, SPLIT, PACKED, PADDED)}
THROUGHPUT_METHODS = (DENSE, SPLIT, PACKED)
"""The candidates the plan measures outside the deterministic mode (PADDED is the deterministic one)."""


class GemmSite:
    """The products over one weight of shape [out, in] (or one expert's slice of a stacked weight).

    `packable`: the weight is fixed (a module's own parameter), so a packed copy can be made; expert
    slices are not. After `bind`, `methods[i]` serves inputs of at most `bounds[i]` rows and the last
    method every larger input; `packed` holds oneDNN's copy when a bound method reads it."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, packable: bool) -> None:
        self.shape = (out_features, in_features)
        self.dtype = dtype
        self.packable = packable
        self.bounds: tuple[int, ...] = ()
        self.methods: tuple[GemmMethod, ...] = (DENSE,)
        self.packed: torch.Tensor | None = None

    def bind(self, bounds: tuple[int, ...], methods: tuple[GemmMethod, ...],
             packed: torch.Tensor | None = None) -> None:
        """Take the plan's rule for this site (and the packed weight when a method reads it)."""
        if len(methods) != len(bounds) + 1:
            raise ValueError(f"{len(methods)} methods for {len(bounds)} row bounds")
        if any(m.storage == "packed" for m in methods) and packed is None:
            raise ValueError("a packed method needs the packed weight")
        self.bounds, self.methods, self.packed = bounds, methods, packed

    @property
    def batch_invariant(self) -> bool:
        return all(m.batch_invariant for m in self.methods)

    @property
    def storages(self) -> frozenset[str]:
        return frozenset(m.storage for m in self.methods)

    def method_for(self, rows: int) -> GemmMethod:
        methods = self.methods
        return methods[0] if len(methods) == 1 else methods[bisect_left(self.bounds, rows)]

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ weight.T (+ bias) by the method bound for x's row count."""
        if x.dim() != 2:
            flat = self.apply(x.reshape(-1, x.shape[-1]), weight, bias)
            return flat.view(*x.shape[:-1], flat.shape[-1])
        return self.method_for(x.shape[0]).apply(x, weight, self.packed, bias)

    def check_integrity(self, weight: torch.Tensor) -> None:
        assert len(self.methods) == len(self.bounds) + 1 and list(self.bounds) == sorted(set(self.bounds))
        if "dense" in self.storages:
            assert tuple(weight.shape[-2:]) == self.shape, "a dense method without the dense weight"
        assert ("packed" in self.storages) == (self.packed is not None)


class GemmOwner:
    """A module whose products run through `GemmSite`s; it names each site with the weight it
    multiplies (2-D: an expert site gets its stack's first expert, of the same shape as every other)."""

    def gemm_sites(self) -> Iterator[tuple[GemmSite, torch.Tensor]]:
        raise NotImplementedError
