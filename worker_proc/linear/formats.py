"""One `LinearMethod` per storage format of a product's weight (`dense`, `int8`, `int4`, `fp8`): the object a
product site gets once, when its weight takes its format, and that owns everything the format decides.

- `create_weight`: the stored weight made from a dense one (`--quantization`; a pre-quantized checkpoint's
  readers, worker_proc.loading.checkpoint_formats, make the same `QuantizedWeight`s and hand them to the same
  method); a dense weight stays its module's own tensor;
- `process_after_loading`: the layouts the kernels bound by the execution plan read besides the stored weight
  (second copies: oneDNN's packed layout or the tiled one of a dense weight, a quantized weight's int8 or
  4-bit tiles), made once, after the load;
- `apply`: one product by a bound kernel, on what that kernel reads;
- `kernels`: the products it can run. `candidates` are the ones the plan times on the CPU
  (worker_proc.plan), `deterministic` serves the batch-invariant mode, `accelerator` every product off the
  CPU, `reference` a site never bound (and every test's ground truth).

Which kernel runs at which row count stays the execution plan's: a method says what can run, never what
does. Adding a format: a `QuantizedWeight` layout and its products (worker_proc.quant.weight), its kernels
(worker_proc.linear.kernels), one `LinearMethod` here, registered in `LINEAR_METHODS`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from worker_proc.linear.kernels import (
    ANY_DEVICE,
    COPIES,
    DENSE,
    DEQUANT,
    FP8_BF16,
    FP8_SCALED,
    GATHERED,
    GATHERED_INT8,
    GATHERED_SEQ,
    GEMV,
    GEMV_INT8,
    GEMV_SEQ,
    GEMV_W8A8,
    PACKED,
    PADDED,
    SPLIT,
    TILED,
    TILED_OVER_INT4,
    TILED_W4A8,
    TILED_W8A8,
    W4A16,
    W8A8,
    W8A16,
    GemmKernel,
    SiteTraits,
    packing_supported,
)
from worker_proc.quant.weight import (
    QuantizedWeight,
    int4_group,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)


@dataclass(frozen=True, eq=False)
class LinearMethod:
    """The products over weights stored in one format (see the module doc). The base class is the dense
    format's; each quantized format overrides what differs."""

    storage: str
    candidates: tuple[GemmKernel, ...]
    deterministic: GemmKernel
    accelerator: GemmKernel
    reference: GemmKernel

    @property
    def kernels(self) -> tuple[GemmKernel, ...]:
        return tuple(dict.fromkeys((*self.candidates, self.deterministic, self.accelerator, self.reference)))

    def create_weight(self, weight: torch.Tensor, amax: torch.Tensor | None = None) -> QuantizedWeight | None:
        """The stored weight made from `weight` [..., out, in] (None: the dense tensor is stored as it is);
        `amax`: each row's max |w| over the whole row where `weight` holds a slice of every row."""
        return None

    def reads(self, kernel: GemmKernel) -> bool:
        """Whether `kernel` reads what a site of this format holds: the stored weight, or (dense) a copy of it."""
        return kernel.storage == self.storage or self.storage == "dense" and kernel.storage in COPIES

    def serves(self, kernel: GemmKernel, site: SiteTraits, device: torch.device) -> bool:
        """Whether `kernel` can run this site's products on `device`: it reads this format, within its own limits,
        gathered kernels on expert stacks only, and the format's own rule (`holds_what_it_reads`)."""
        if not self.reads(kernel) or not kernel.runs_on(site.shape, site.dtype, device):
            return False
        return not (kernel.experts_only and not site.experts) and self.holds_what_it_reads(kernel, site, device)

    def holds_what_it_reads(self, kernel: GemmKernel, site: SiteTraits, device: torch.device) -> bool:
        """A copy of a dense weight only where the weight is fixed (and oneDNN packs its dtype on `device`)."""
        if kernel.storage in COPIES:
            return site.packable and (kernel.storage != "packed" or packing_supported(site.dtype, device))
        return True

    def process_after_loading(self, site: SiteTraits, kernels: Iterable[GemmKernel],
                              weight: torch.Tensor) -> dict[str, object]:
        """The copies of `weight` the `kernels` read (by storage), made now."""
        return {k.storage: COPIES[k.storage](weight) for k in kernels if k.storage in COPIES}

    def stored(self, site: SiteTraits, kernel: GemmKernel, expert: int | None = None) -> object:
        """What `kernel` reads besides the dense weight: the copy the site holds for it, if any."""
        return site.copies.get(kernel.storage)

    def apply(self, site: SiteTraits, kernel: GemmKernel, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, expert: int | None = None) -> torch.Tensor:
        return kernel.apply(x, weight, self.stored(site, kernel, expert), bias)


@dataclass(frozen=True, eq=False)
class QuantizedLinear(LinearMethod):
    """A quantized format: the site holds a `QuantizedWeight` (with the copies its bound kernels read) in place
    of the dense weight."""

    def holds_what_it_reads(self, kernel: GemmKernel, site: SiteTraits, device: torch.device) -> bool:
        """A quantized copy only of a single matrix; a per-row-scale kernel only over per-row scales."""
        if kernel.quantized_copy and not site.packable:
            return False
        q = site.quantized
        return not (kernel.per_row_scale and q is not None and q.group)

    def process_after_loading(self, site: SiteTraits, kernels: Iterable[GemmKernel],
                              weight: torch.Tensor) -> dict[str, object]:
        """The quantized weight's copies the `kernels` read, made on it (`QuantizedWeight.with_copy`)."""
        assert site.quantized is not None and site.quantized.fmt == self.storage
        for kind in sorted({k.quantized_copy for k in kernels} - {""}):
            site.quantized = site.quantized.with_copy(kind)
        return {}

    def stored(self, site: SiteTraits, kernel: GemmKernel, expert: int | None = None) -> object:
        q = site.quantized
        assert q is not None, "a quantized method on a site without a quantized weight"
        return q if expert is None else q[expert]


class Int8Linear(QuantizedLinear):
    def create_weight(self, weight: torch.Tensor, amax: torch.Tensor | None = None) -> QuantizedWeight:
        return quantize_int8(weight, amax)


class Int4Linear(QuantizedLinear):
    def create_weight(self, weight: torch.Tensor, amax: torch.Tensor | None = None) -> QuantizedWeight:
        """Groups of the smallest size dividing the input width; an `int8` weight where torch's 4-bit layout
        cannot hold the shape (the caller then takes `LINEAR_METHODS[q.fmt]`)."""
        group = int4_group(weight.shape[-1], weight.shape[-2])
        return quantize_int4(weight, group) if group else quantize_int8(weight, amax)


class Fp8Linear(QuantizedLinear):
    def create_weight(self, weight: torch.Tensor, amax: torch.Tensor | None = None) -> QuantizedWeight:
        return quantize_fp8(weight, amax)


DENSE_LINEAR = LinearMethod("dense", (DENSE, SPLIT, PACKED, TILED, GEMV, GEMV_SEQ, GATHERED, GATHERED_SEQ), PADDED,
                            DENSE, DENSE)
INT8_LINEAR = Int8Linear("int8", (GEMV_INT8, GEMV_W8A8, GATHERED_INT8, W8A16, W8A8, TILED_W8A8), W8A8,
                         W8A8, DEQUANT["int8"])
INT4_LINEAR = Int4Linear("int4", (W4A16, TILED_OVER_INT4, TILED_W4A8), W4A16, DEQUANT["int4"],
                         DEQUANT["int4"])
FP8_LINEAR = Fp8Linear("fp8", (FP8_BF16,), DEQUANT["fp8"], FP8_SCALED, DEQUANT["fp8"])
LINEAR_METHODS: dict[str, LinearMethod] = {m.storage: m for m in (DENSE_LINEAR, INT8_LINEAR, INT4_LINEAR, FP8_LINEAR)}
"""Every storage format's method, by name (`dense` and `QuantizedWeight.fmt`)."""
THROUGHPUT_KERNELS = tuple(dict.fromkeys(k for m in LINEAR_METHODS.values() for k in m.candidates))
"""The kernels the plan times on the CPU outside the deterministic mode, every format's candidates."""
assert all(k.devices == ANY_DEVICE for k in (DENSE, *DEQUANT.values())), "a reference must run anywhere"
