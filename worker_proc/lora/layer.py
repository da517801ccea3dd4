"""`LoraLayer`: one linear layer's adapters, one per slot that targets it, and the LoRA product it adds.

Owned by the rank's `LoraSlots` (worker_proc.lora.slots), which makes one for every linear layer of the
decoder (the layers `shared.lora.linear_layers` names) and hangs it on the `Linear` as `lora`. What holds:
- a slot's A is [r, in] and its B [out, r] with the adapter's scaling folded in, both in the model dtype,
  sliced for this rank as the base weight is (worker_proc.lora.slots); they are float whatever format the
  base weight is stored in, and the base product is the execution plan's, untouched;
- `add(x, out)` adds (x A^T) B^T to the rows of `out` of each slot with an adapter here, one pair of
  products per slot over all of that slot's rows together (the segmented, punica-shaped batch); a row of
  the base model (slot 0) or of an adapter that does not target this layer is not touched at all;
- in a step of up to the plan's `lora_native_rows` rows (`LoraSlots.native`), every row's term is one call of the
  native `lora_add` (worker_proc/kernels/native/lora_ops.cpp) over the layer's adapters stacked (`packed`: A
  [sum r, in], B^T [sum r, out], and each slot's rows of them), each row reading its own slot's rows (the
  step's `row_slot`): one call per layer whatever the mix of adapters, batch invariant, and free of Python
  decisions that depend on the rows, so such a decode step is replayed (worker_proc.runtime.step_replay);
  `packed` is made again whenever a slot changes;
- on a row-parallel layer `x` holds this rank's input columns and A its matching columns, so the term is
  this rank's partial sum, summed by the base product's all-reduce (worker_proc.model.tp.row_parallel);
- the products run on the kernel the plan gives every LoRA product (`LoraSlots.kernel`,
  `ExecutionPlan.lora_kernel`): in the deterministic mode a batch-invariant one, so a row's term does not
  depend on how many rows share its slot; a product onto one column (a rank-1 A, a one-output layer's B) is
  a row-wise dot product whatever the kernel, since a one-column GEMM's rounding depends on the row count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from worker_proc.linear.kernels import GemmKernel


class StepRows(Protocol):
    """What a layer reads of its owner (worker_proc.lora.slots.LoraSlots) during a forward."""

    groups: tuple[tuple[int, slice | torch.Tensor], ...]
    rows: int
    kernel: GemmKernel
    native: bool
    row_slot: torch.Tensor | None
    max_loras: int


def _product(kernel: GemmKernel, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T on `kernel`, or as row-wise dot products where `weight` has one row (see the module doc)."""
    if weight.shape[0] == 1:
        return (x * weight[0]).sum(-1, keepdim=True)
    return kernel.apply(x, weight, None, None)


class LoraLayer:
    """The adapters of one linear layer, by slot (see the module doc)."""

    def __init__(self, slots: StepRows, name: str, out_features: int, in_features: int) -> None:
        self.slots = slots
        self.name = name
        self.shape = (out_features, in_features)
        """This rank's [out, in] of the base weight: what every slot's B @ A must be."""
        self.pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """`pairs` as the native op reads them (see the module doc), None while no slot has an adapter here."""

    def _pack(self) -> None:
        if not self.pairs:
            self.packed = None
            return
        slots = sorted(self.pairs)
        cols = torch.zeros(self.slots.max_loras + 1, 2, dtype=torch.int64)
        at = 0
        for s in slots:
            r = self.pairs[s][0].shape[0]
            cols[s] = torch.tensor([at, at + r])
            at += r
        a = torch.cat([self.pairs[s][0] for s in slots]).contiguous()
        bt = torch.cat([self.pairs[s][1].t() for s in slots]).contiguous()
        self.packed = (a, bt, cols.to(a.device))

    def put(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if (b.shape[0], a.shape[1]) != self.shape or a.shape[0] != b.shape[1]:
            raise ValueError(f"{self.name}: LoRA A {tuple(a.shape)} and B {tuple(b.shape)} do not fit its "
                             f"weight {self.shape}")
        self.pairs[slot] = (a, b)
        self._pack()

    def drop(self, slot: int) -> None:
        if self.pairs.pop(slot, None) is not None:
            self._pack()

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base product of `x`, this call's own tensor) with every slot's LoRA term added in place
        to that slot's rows of the current step."""
        slots = self.slots
        if slots.rows == 0 or self.packed is None:
            return out
        if x.dim() != 2 or x.shape[0] != slots.rows:
            raise RuntimeError(f"{self.name}: a LoRA layer called on {tuple(x.shape)}, not on the step's "
                               f"{slots.rows} rows")
        if slots.native:
            a, bt, cols = self.packed
            return torch.ops.hyssm_cpu.lora_add(out, x, a, bt, cols, slots.row_slot)
        groups, kernel = slots.groups, slots.kernel
        fused = not kernel.batch_invariant
        for slot, rows in groups:
            pair = self.pairs.get(slot)
            if pair is None:
                continue
            a, b = pair
            if fused and isinstance(rows, slice) and a.shape[0] > 1 and b.shape[0] > 1:
                out[rows].addmm_(torch.mm(x[rows], a.t()), b.t())  # the default numerics: the sum in the product
                continue
            term = _product(kernel, _product(kernel, x[rows], a), b)
            if isinstance(rows, slice):
                out[rows] += term
            else:
                out.index_add_(0, rows, term)
        return out
