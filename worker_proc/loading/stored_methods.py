"""One `LinearMethod` per scheme a pre-quantized checkpoint stores its weights in (`stored_method`).

Each is the method of the format the scheme's weights are held in (worker_proc.linear.formats: the same kernels,
the same copies after loading, the same `apply`) with what the scheme decides on top: whether a rank's part of
a module can be held in the format at all (`layout_problem`; "" when it can, else why it is loaded dense), and
making the held weight from the checkpoint's tensors (`read_weight`) or, where it cannot be held, the dense
matrix they stand for (`read_dense`). A site holding such a weight takes its scheme's method
(`GemmSite.quantize`). The conversions themselves are worker_proc.loading.checkpoint_formats'.

Adding a scheme: its `StoredScheme` (worker_proc.loading.checkpoint_config says which configs declare it), a
method here over the format it is held in, and its case in `stored_method`.
"""

from __future__ import annotations

import dataclasses

import torch

from shared.errors import ModelLoadError
from worker_proc.linear.formats import (
    FP8_LINEAR,
    INT4_LINEAR,
    INT8_LINEAR,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    LinearMethod,
    QuantizedLinear,
)
from worker_proc.loading.checkpoint_config import StoredScheme
from worker_proc.loading.checkpoint_formats import (
    Part,
    Read,
    block_fp8,
    int4_dequantized,
    int4_layout_group,
    int4_parts,
    int4_weight,
    matrix_values,
    narrow_int4,
    row_scale,
    scheme_group,
)
from worker_proc.quant.weight import INT4_OUT_MULTIPLE, QuantizedWeight


@dataclasses.dataclass(frozen=True, eq=False)
class StoredLinear(QuantizedLinear):
    """A pre-quantized scheme's method (see the module doc); `scheme` as config.json declares it."""

    scheme: StoredScheme | None = None

    def layout_problem(self, part: Part, device: torch.device) -> str:
        """Why `part` cannot be held in the format (it is loaded dense instead), "" when it can. Raises
        ModelLoadError where the tensor-parallel slice itself cuts the scheme's blocks or groups."""
        return ""

    def read_weight(self, read: Read, prefix: str, part: Part, device: torch.device) -> QuantizedWeight:
        """Module `prefix`'s `part` as the format holds it."""
        raise NotImplementedError

    def read_dense(self, read: Read, prefix: str, part: Part, device: torch.device) -> torch.Tensor:
        """Module `prefix`'s `part` dequantized, float32 [out, in]."""
        raise NotImplementedError

    @property
    def checkpoint_scheme(self) -> StoredScheme:
        assert self.scheme is not None, "a stored scheme's method without its scheme"
        return self.scheme


@dataclasses.dataclass(frozen=True, eq=False)
class StoredInt8Linear(StoredLinear, Int8Linear):
    """compressed-tensors int8 (`weight` int8, a scale per row or one per tensor): held as stored, exactly."""

    def read_weight(self, read: Read, prefix: str, part: Part, device: torch.device) -> QuantizedWeight:
        values = matrix_values(read, prefix, part, torch.int8, self.checkpoint_scheme)
        scale = row_scale(read, f"{prefix}.{self.checkpoint_scheme.scale_name}", part)
        # a fresh copy: the tensor read may sit unaligned in the file's buffer, and torch's int8-weight CPU
        # kernel reads past an unaligned end
        return QuantizedWeight("int8", values.to(device, copy=True), scale.to(device), part.local)

    def read_dense(self, read: Read, prefix: str, part: Part, device: torch.device) -> torch.Tensor:
        values = matrix_values(read, prefix, part, torch.int8, self.checkpoint_scheme)
        return values.float() * row_scale(read, f"{prefix}.{self.checkpoint_scheme.scale_name}", part)[:, None]


@dataclasses.dataclass(frozen=True, eq=False)
class StoredFp8Linear(StoredLinear, Fp8Linear):
    """e4m3 with a scale per row or per tensor: `fp8` per row as stored (on the CPU the values in bfloat16,
    exact)."""

    def read_weight(self, read: Read, prefix: str, part: Part, device: torch.device) -> QuantizedWeight:
        held = matrix_values(read, prefix, part, torch.float8_e4m3fn, self.checkpoint_scheme)
        held = held.to(device) if device.type == "cuda" else held.to(torch.bfloat16)
        scale = row_scale(read, f"{prefix}.{self.checkpoint_scheme.scale_name}", part)
        return QuantizedWeight("fp8", held, scale.to(device), part.local)

    def read_dense(self, read: Read, prefix: str, part: Part, device: torch.device) -> torch.Tensor:
        values = matrix_values(read, prefix, part, torch.float8_e4m3fn, self.checkpoint_scheme)
        return values.float() * row_scale(read, f"{prefix}.{self.checkpoint_scheme.scale_name}", part)[:, None]


@dataclasses.dataclass(frozen=True, eq=False)
class StoredBlockFp8Linear(StoredLinear, Fp8Linear):
    """e4m3 with a scale per block (`weight_scale_inv` / `weight_scale`): the blocks as stored on CUDA (square
    ones, a slice that does not cut them), re-encoded per row on the CPU (checkpoint_formats' module doc)."""

    def layout_problem(self, part: Part, device: torch.device) -> str:
        if device.type == "cpu":
            return ""
        bo, bi = self.checkpoint_scheme.block
        if bo != bi:
            raise ModelLoadError(f"fp8 blocks {bo}x{bi} are not supported on {device.type} (square blocks only)")
        for dim in (0, 1):
            for a, b in part.ranges(dim):
                if a % bo or (b % bo and b != part.shape[dim]):
                    where = f"{'rows' if dim == 0 else 'columns'} {a}-{b}"
                    raise ModelLoadError(f"the tensor-parallel split of a {part.shape[0]}x{part.shape[1]} fp8 weight "
                                         f"at {where} cuts its {bo}x{bi} blocks")
        return ""

    def read_weight(self, read: Read, prefix: str, part: Part, device: torch.device) -> QuantizedWeight:
        values = matrix_values(read, prefix, part, torch.float8_e4m3fn, self.checkpoint_scheme)
        held = block_fp8(read, prefix, self.checkpoint_scheme, part, values, device, dense=False)
        assert isinstance(held, QuantizedWeight)
        return held

    def read_dense(self, read: Read, prefix: str, part: Part, device: torch.device) -> torch.Tensor:
        values = matrix_values(read, prefix, part, torch.float8_e4m3fn, self.checkpoint_scheme)
        dense = block_fp8(read, prefix, self.checkpoint_scheme, part, values, device, dense=True)
        assert isinstance(dense, torch.Tensor)
        return dense


@dataclasses.dataclass(frozen=True, eq=False)
class StoredInt4Linear(StoredLinear, Int4Linear):
    """compressed-tensors 4-bit (`weight_packed`, group or channel scales, optional zero points): the CPU 4-bit
    layout, its (s, z) in bfloat16 where every one is exact there (checkpoint_formats' module doc)."""

    def layout_problem(self, part: Part, device: torch.device) -> str:
        out, inp = part.local
        group = scheme_group(self.checkpoint_scheme, part)
        if out % INT4_OUT_MULTIPLE:
            return f"output width {out} is not a multiple of {INT4_OUT_MULTIPLE}"
        if not int4_layout_group(self.checkpoint_scheme, part):
            if part.spec is not None and part.spec.dim == 1:
                raise ModelLoadError(f"the tensor-parallel split of a {part.shape[0]}x{part.shape[1]} 4-bit weight at "
                                     f"columns {part.spec.ranges} cuts its {group}-input groups")
            return f"no 4-bit layout group divides its {inp} inputs and {group}-input groups"
        return ""

    def read_weight(self, read: Read, prefix: str, part: Part, device: torch.device) -> QuantizedWeight:
        scheme = self.checkpoint_scheme
        return narrow_int4(int4_weight(int4_parts(read, prefix, scheme, part), scheme, part))

    def read_dense(self, read: Read, prefix: str, part: Part, device: torch.device) -> torch.Tensor:
        return int4_dequantized(int4_parts(read, prefix, self.checkpoint_scheme, part))


def _like(cls: type[StoredLinear], base: LinearMethod, scheme: StoredScheme) -> StoredLinear:
    """`cls` with `base`'s kernels (the format's method) and `scheme`."""
    kernels = {f.name: getattr(base, f.name) for f in dataclasses.fields(LinearMethod)}
    return cls(**kernels, scheme=scheme)


def stored_method(scheme: StoredScheme) -> StoredLinear:
    """The method of the weights stored in `scheme`."""
    if scheme.kind == "int4":
        return _like(StoredInt4Linear, INT4_LINEAR, scheme)
    if scheme.kind == "int8":
        return _like(StoredInt8Linear, INT8_LINEAR, scheme)
    if scheme.strategy == "block":
        return _like(StoredBlockFp8Linear, FP8_LINEAR, scheme)
    return _like(StoredFp8Linear, FP8_LINEAR, scheme)
