"""`GemmSite`, the one object each matrix product of a worker's model goes through, and `GemmOwner`, a
module whose products do.

A site gets its `LinearMethod` (worker_proc.linear.formats) once, when its weight takes its storage format:
the dense one at construction, a quantized one at `quantize`. Which of the method's kernels
(worker_proc.linear.kernels) it runs at which row count is the execution plan's decision
(worker_proc.plan.execution_plan binds every site once, after the weights are loaded); a site only holds the
storages its kernels read and picks the kernel by the input's row count. Storages: `dense` (the module's own
[out, in] tensor, passed in on each call), the copies its method makes of it at bind (`COPIES`) or, for a
quantized site, its `QuantizedWeight` (worker_proc.quant.weight, with the copies its kernels read) and
nothing else. A site that was never bound runs its method's `reference` kernel at every row count.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

import torch
from torch import nn

from worker_proc.linear.formats import DENSE_LINEAR, LINEAR_METHODS, LinearMethod
from worker_proc.linear.kernels import COPIES, GATHERED_SEQ, GemmKernel, TiledWeight, untile_weight
from worker_proc.quant.weight import QuantizedWeight


class GemmSite:
    """The products over one weight of shape [out, in] (or over each expert of a stack [E, out, in]).

    `packable`: the weight is fixed (a module's own parameter), so a packed copy can be made; expert
    slices are not. `quantizable`: worker_proc.model.quantization may replace the weight by a
    `QuantizedWeight` (`quantized`, held here; the owner drops its dense copy). After `bind`,
    `methods[i]` serves inputs of at most `bounds[i]` rows and the last method every larger input;
    `copies` holds each of `COPIES` a bound method reads (by storage)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, packable: bool,
                 quantizable: bool = True, dense_kept: bool = False, timed_rows: int = 0,
                 experts: bool = False) -> None:  # fmt: skip
        self.shape = (out_features, in_features)
        self.experts = experts
        """The site multiplies each expert of a stack [E, out, in] (its gathered kernels apply)."""
        self.dtype = dtype
        self.packable = packable
        self.dense_kept = dense_kept
        """The owner reads the dense weight itself (a tied LM head's embedding lookups), so it stays
        whatever the plan binds: a packed copy is always a second copy."""
        self.timed_rows = timed_rows
        """The most rows the plan times it at (0: every bucket); larger products take the choice made
        for the largest bucket timed. An LM head sees a step's sampled rows, not its prompt tokens."""
        self.quantizable = quantizable
        self.method: LinearMethod = DENSE_LINEAR
        self.quantized: QuantizedWeight | None = None
        self.bounds: tuple[int, ...] = ()
        self.methods: tuple[GemmKernel, ...] = (self.method.reference,)
        self.copies: dict[str, object] = {}

    @property
    def storage_format(self) -> str:
        """`dense` or the quantized format the site's weight is held in."""
        return self.quantized.fmt if self.quantized is not None else "dense"

    def quantize(self, weight: QuantizedWeight, method: LinearMethod | None = None) -> None:
        """Hold `weight` in place of the dense one, under `method` (a pre-quantized scheme's,
        worker_proc.loading.stored_methods) or its format's."""
        if not self.quantizable:
            raise ValueError("this product's weight stays in the model dtype")
        method = method or LINEAR_METHODS[weight.fmt]
        if method.storage != weight.fmt:
            raise ValueError(f"a {weight.fmt} weight under the {method.storage} method")
        self.quantized = weight
        self.method = method
        self.methods = (self.method.reference,)
        self.bounds = ()

    def bind(self, bounds: tuple[int, ...], methods: tuple[GemmKernel, ...],
             weight: torch.Tensor | None = None) -> None:
        """Take the plan's rule for this site: `methods[i]` up to `bounds[i]` rows. The site's `LinearMethod`
        makes the copies the kernels read (of the dense `weight`, or on its quantized weight)."""
        if len(methods) != len(bounds) + 1:
            raise ValueError(f"{len(methods)} methods for {len(bounds)} row bounds")
        wrong = [m.name for m in methods if not self.method.reads(m)]
        if wrong:
            raise ValueError(f"{', '.join(wrong)} cannot read a {self.storage_format} weight")
        copied = sorted({m.storage for m in methods if m.storage in COPIES})
        if copied and (weight is None or tuple(weight.shape) != self.shape):
            raise ValueError(f"a {', '.join(copied)} method needs the dense weight to make the "
                             f"{', '.join(copied)} weight from")
        self.copies = self.method.process_after_loading(self, methods, torch.empty(0) if weight is None else weight)
        self.bounds, self.methods = bounds, methods

    @property
    def batch_invariant(self) -> bool:
        return all(m.batch_invariant for m in self.methods)

    @property
    def storages(self) -> frozenset[str]:
        return frozenset(m.storage for m in self.methods)

    def method_for(self, rows: int) -> GemmKernel:
        methods = self.methods
        return methods[0] if len(methods) == 1 else methods[bisect_left(self.bounds, rows)]

    def stored(self, method: GemmKernel, expert: int | None = None) -> object:
        """What `method` reads besides the dense weight: the quantized weight (an expert's) or its copy."""
        return self.method.stored(self, method, expert)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ weight.T (+ bias) by the method bound for x's row count."""
        if x.dim() != 2:
            flat = self.apply(x.reshape(-1, x.shape[-1]), weight, bias)
            return flat.view(*x.shape[:-1], flat.shape[-1])
        return self.method.apply(self, self.method_for(x.shape[0]), x, weight, bias)

    def apply_expert(self, x: torch.Tensor, stack: torch.Tensor, expert: int) -> torch.Tensor:
        """x [T, in] @ stack[expert].T, the expert's quantized matrix when the stack is quantized."""
        weight = stack if self.quantized is not None else stack[expert]
        return self.method.apply(self, self.method_for(x.shape[0]), x, weight, None, expert)

    def gathers(self, rows: int) -> bool:
        """Whether an expert stack's products for `rows` routed tokens run as one `apply_gathered` call: the plan
        bound one of the gathered kernels at that row count (`GemmKernel.experts_only`; they were timed as they
        run)."""
        return self.method_for(rows).experts_only

    def apply_gathered(self, x: torch.Tensor, stack: torch.Tensor, idx: torch.Tensor, per_choice: bool) -> torch.Tensor:
        """For every routing choice c = (t, j) of idx [T, k]: x's row (x[t], or x[c] when `per_choice`) @
        stack[idx[t, j]].T, as [T * k, out] in choice order; each chosen expert read once for its rows by the
        gathered kernel bound for T rows. Only where `gathers(T)`."""
        kernel = self.method_for(idx.shape[0])
        assert kernel.experts_only, f"{kernel.name} is not a gathered kernel"
        if self.quantized is not None:
            q = self.quantized
            return torch.ops.hyssm_cpu.expert_product(x, q.data, q.scale, idx, per_choice, True)
        sequential = kernel is GATHERED_SEQ
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
