"""`GemmSite`, the one object each matrix product of a worker's model goes through, and `GemmOwner`, a
module whose products do.

Which method (worker_proc.linear.methods) a site runs at which row count is the execution plan's
decision (worker_proc.plan.execution_plan binds every site once, after the weights are loaded); a site only
holds the storages its methods read and picks the method by the input's row count. Storages: `dense`
(the module's own [out, in] tensor, passed in on each call), the copies the site makes of it at bind
(`COPIES`) or, for a quantized site, its `QuantizedWeight` (worker_proc.quant.weight, with the int8
copies its methods read) and nothing else. A site that was never bound runs `DENSE` (F.linear) at every
row count, a quantized one `dequant`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

import torch
from torch import nn

from worker_proc.linear.methods import (
    COPIES,
    DENSE,
    DEQUANT,
    GEMV,
    GEMV_INT8,
    GEMV_SEQ,
    GEMV_W8A8,
    GemmMethod,
    TiledWeight,
    untile_weight,
)
from worker_proc.quant.weight import QuantizedWeight


class GemmSite:
    """The products over one weight of shape [out, in] (or over each expert of a stack [E, out, in]).

    `packable`: the weight is fixed (a module's own parameter), so a packed copy can be made; expert
    slices are not. `quantizable`: worker_proc.model.quantization may replace the weight by a
    `QuantizedWeight` (`quantized`, held here; the owner drops its dense copy). After `bind`,
    `methods[i]` serves inputs of at most `bounds[i]` rows and the last method every larger input;
    `copies` holds each of `COPIES` a bound method reads (by storage)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, packable: bool,
                 quantizable: bool = True, dense_kept: bool = False, timed_rows: int = 0) -> None:  # fmt: skip
        self.shape = (out_features, in_features)
        self.dtype = dtype
        self.packable = packable
        self.dense_kept = dense_kept
        """The owner reads the dense weight itself (a tied LM head's embedding lookups), so it stays
        whatever the plan binds: a packed copy is always a second copy."""
        self.timed_rows = timed_rows
        """The most rows the plan times it at (0: every bucket); larger products take the choice made
        for the largest bucket timed. An LM head sees a step's sampled rows, not its prompt tokens."""
        self.quantizable = quantizable
        self.quantized: QuantizedWeight | None = None
        self.bounds: tuple[int, ...] = ()
        self.methods: tuple[GemmMethod, ...] = (DENSE,)
        self.copies: dict[str, object] = {}

    @property
    def storage_format(self) -> str:
        """`dense` or the quantized format the site's weight is held in."""
        return self.quantized.fmt if self.quantized is not None else "dense"

    def quantize(self, weight: QuantizedWeight) -> None:
        if not self.quantizable:
            raise ValueError("this product's weight stays in the model dtype")
        self.quantized = weight
        self.methods = (DEQUANT[weight.fmt],)
        self.bounds = ()

    def bind(self, bounds: tuple[int, ...], methods: tuple[GemmMethod, ...],
             copies: dict[str, object] | None = None) -> None:
        """Take the plan's rule for this site (and the copies of the weight its methods read)."""
        copies = copies or {}
        if len(methods) != len(bounds) + 1:
            raise ValueError(f"{len(methods)} methods for {len(bounds)} row bounds")
        missing = {m.storage for m in methods if m.storage in COPIES} - set(copies)
        if missing:
            raise ValueError(f"a {', '.join(sorted(missing))} method needs the {', '.join(sorted(missing))} weight")
        for kind in sorted({m.quantized_copy for m in methods} - {""}):
            assert self.quantized is not None and self.storage_format in ("int8", "int4"), \
                "a quantized copy of a weight that is neither int8 nor int4"
            self.quantized = self.quantized.with_copy(kind)
        wrong = [m.name for m in methods if m.storage not in (self.storage_format, *COPIES)
                 or m.storage in COPIES and self.quantized is not None]
        if wrong:
            raise ValueError(f"{', '.join(wrong)} cannot read a {self.storage_format} weight")
        self.bounds, self.methods = bounds, methods
        self.copies = {s: c for s, c in copies.items() if s in self.storages}

    @property
    def batch_invariant(self) -> bool:
        return all(m.batch_invariant for m in self.methods)

    @property
    def storages(self) -> frozenset[str]:
        return frozenset(m.storage for m in self.methods)

    def method_for(self, rows: int) -> GemmMethod:
        methods = self.methods
        return methods[0] if len(methods) == 1 else methods[bisect_left(self.bounds, rows)]

    def stored(self, method: GemmMethod, expert: int | None = None) -> object:
        """What `method` reads besides the dense weight: the quantized weight (an expert's) or its copy."""
        if self.quantized is not None:
            return self.quantized if expert is None else self.quantized[expert]
        return self.copies.get(method.storage)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ weight.T (+ bias) by the method bound for x's row count."""
        if x.dim() != 2:
            flat = self.apply(x.reshape(-1, x.shape[-1]), weight, bias)
            return flat.view(*x.shape[:-1], flat.shape[-1])
        method = self.method_for(x.shape[0])
        return method.apply(x, weight, self.stored(method), bias)

    def apply_expert(self, x: torch.Tensor, stack: torch.Tensor, expert: int) -> torch.Tensor:
        """x [T, in] @ stack[expert].T, the expert's quantized matrix when the stack is quantized."""
        weight = stack if self.quantized is not None else stack[expert]
        method = self.method_for(x.shape[0])
        return method.apply(x, weight, self.stored(method, expert), None)

    def gathers(self, rows: int) -> bool:
        """Whether an expert stack's products for `rows` routed tokens run as one `apply_gathered` call: the
        plan bound a native few-row product at that row count (`gemv`, `gemv_seq`; for an int8 stack `gemv_int8`
        or `gemv_w8a8`), so streaming each chosen expert is what pays there (no expert list read into Python,
        so the step can be replayed)."""
        return self.method_for(rows) in (GEMV, GEMV_SEQ, GEMV_INT8, GEMV_W8A8)

    def apply_gathered(self, x: torch.Tensor, stack: torch.Tensor, idx: torch.Tensor, per_choice: bool) -> torch.Tensor:
        """For every routing choice c = (t, j) of idx [T, k]: x's row (x[t], or x[c] when `per_choice`) @
        stack[idx[t, j]].T, as [T * k, out] in choice order; each chosen expert read once for its rows, in
        the order of the method bound for T rows. An int8 stack is read with its row scales on float32
        activations (`gemv_int8`'s arithmetic, whichever int8 product is bound). Only where `gathers(T)`."""
        if self.quantized is not None:
            q = self.quantized
            return torch.ops.hyssm_cpu.expert_product(x, q.data, q.scale, idx, per_choice, True)
        sequential = self.method_for(idx.shape[0]) is GEMV_SEQ
        return torch.ops.hyssm_cpu.expert_product(x, stack, None, idx, per_choice, sequential)

    def dense_from_copies(self) -> torch.Tensor:
        """The dense weight again, from a copy the site holds (for an owner that dropped its dense weight
        and is bound anew to a rule that reads it)."""
        if "tiled" in self.copies:
            tiled = self.copies["tiled"]
            assert isinstance(tiled, TiledWeight)
            return untile_weight(tiled)
        packed = self.copies.get("packed")
        if not isinstance(packed, torch.Tensor):
            raise ValueError("the site holds no copy of its weight to restore the dense weight from")
        return packed.to_dense()

    def weight_bytes(self, weight: torch.Tensor) -> int:
        """Bytes one product reads (one expert's, for a stack)."""
        q = self.quantized
        if q is not None:
            return q.nbytes // max(q.experts, 1)
        return weight.numel() * weight.element_size()

    def check_integrity(self, weight: torch.Tensor) -> None:
        assert len(self.methods) == len(self.bounds) + 1 and list(self.bounds) == sorted(set(self.bounds))
        if "dense" in self.storages:
            assert tuple(weight.shape[-2:]) == self.shape, "a dense method without the dense weight"
        assert set(self.copies) == self.storages & set(COPIES), "a copy without its method, or the reverse"
        if self.quantized is not None:
            assert self.storages == {self.quantized.fmt} and self.quantized.shape == self.shape
            self.quantized.check_integrity()


class GemmOwner:
    """A module whose products run through `GemmSite`s; it names each site with the module and the
    parameter name of the whole weight the site multiplies (the stack [E, out, in], for experts)."""

    def gemm_weights(self) -> Iterator[tuple[GemmSite, nn.Module, str]]:
        raise NotImplementedError

    def gemm_sites(self) -> Iterator[tuple[GemmSite, torch.Tensor]]:
        """Each site with its dense weight (a stack's first expert, of every expert's shape; an empty
        tensor once the site is quantized or reads only a packed copy)."""
        for site, module, name in self.gemm_weights():
            weight = getattr(module, name)
            yield site, weight[0] if weight.dim() == 3 else weight
