"""The per-channel gated delta rule behind `KernelOps` (`kda_prefill_many`, `kda_decode`): which
implementation runs for Kimi Delta Attention layers.

`ReferenceKda` is the pure-torch form (worker_proc.kernels.kimi_delta) and runs on every device;
`FlaKda` calls flash-linear-attention's KDA Triton kernels (`fla.ops.kda`, the optional `fla-core`
package); `NativeKda` (worker_proc.kernels.native.ops) the fused CPU kernel of `delta_ops.cpp`.
`kda_choice` names FlaKda on CUDA when that module imports, the native one on the CPU under the
native kernel set, else the reference (logged); the kernel set (worker_proc.plan.kernel_set) asks it
and hands the backend to its ops. Every backend
reads and writes the state pool only at the slots it is given, through `state_codec` (float32,
bfloat16 or int8 storage; the rule runs on the decoded float32 state, encoded once per call); q and k
arrive L2-normalised, q not yet scaled; g is the per-channel log decay [.., H, Dk].
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.gdn_ops import FlaDeltaRule
from worker_proc.kernels.interface import Spans
from worker_proc.kernels.kimi_delta import CHUNK_SIZE, kda_chunked, kda_step
from worker_proc.kernels.state_codec import StatePool

logger = logging.getLogger(__name__)


Chunked = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, StatePool, int], Tensor]
"""A backend's one-segment prefill: (q, k, v, g, beta, scale, state_pool, slot) -> o."""


def each_segment(chunked: Chunked, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                 state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
    """`chunked` once per span of the concatenated rows, the outputs concatenated in order."""
    outs, start = [], 0
    for length, slot in spans:
        rows = slice(start, start + length)
        outs.append(chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], scale, state_pool, slot))
        start += length
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class ReferenceKda:
    """Pure torch; `chunked`: one prefill segment in chunks of `CHUNK_SIZE`; `prefill_many`: each span's
    segment by `chunked`; `step`: one token for every decode row, batched. Batch invariant: a row's numbers
    never depend on the rows beside it."""

    name = "reference"

    def prefill_many(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                     state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
        return each_segment(self.chunked, q, k, v, g, beta, scale, state_pool, spans)

    def chunked(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                state_pool: StatePool, slot: int) -> Tensor:  # fmt: skip
        o, final = kda_chunked(q, k, v, g, beta, scale, codec.load(state_pool, slot), CHUNK_SIZE)
        codec.store(final, state_pool, slot)
        return o

    def step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
             state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        o, new_state = kda_step(codec.load(state_pool, slots), q, k, v, g, beta, scale)
        codec.store(new_state, state_pool, slots)
        return o


class FlaKda(FlaDeltaRule):
    """Kimi Delta Attention on flash-linear-attention's `chunk_kda` / `fused_recurrent_kda` (g per channel,
    [.., H, Dk]); the dtypes and the state as `FlaDeltaRule` says. Raises ImportError without `fla`."""

    def __init__(self) -> None:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        super().__init__(chunk_kda, fused_recurrent_kda)

    def prefill_many(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                     state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
        return each_segment(self.chunked, q, k, v, g, beta, scale, state_pool, spans)


def kda_choice(device: torch.device | str, native: bool = False) -> str:
    """`fla` on CUDA when flash-linear-attention's KDA kernels import; on the CPU `native` with `native` (the
    native kernel set runs, its library loaded), else `reference`; the kernel set builds the one named. The native
    kernel was measured faster than the reference at every shape tried, decode and prefill
    (worker_proc.kernels.native.ops.NativeKda)."""
    if torch.device(device).type != "cuda":
        return "native" if native else "reference"
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError as exc:
        logger.info("fla-core's KDA kernels not importable (%s): Kimi Delta Attention uses the pure-torch kernels",
                    exc)
        return "reference"
    return "fla"


class KdaMethods:
    """The `KernelOps` KDA methods, delegated to `self.kda` (a backend above; the kernel set sets it)."""

    kda: ReferenceKda | FlaKda = ReferenceKda()

    def kda_prefill_many(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                         state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
        return self.kda.prefill_many(q, k, v, g, beta, scale, state_pool, spans)

    def kda_decode(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                   state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        return self.kda.step(q, k, v, g, beta, scale, state_pool, slots)
