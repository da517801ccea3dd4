"""The gated delta rule behind `KernelOps` (`gdn_prefill`, `gdn_decode`): which implementation runs.

`ReferenceGdn` is the pure-torch form (worker_proc.kernels.gated_delta) and runs on every device;
`FastGdn` (the `fast` CPU kernels' choice) advances each decode request's pool row in place instead
of gathering and scattering the states (a Qwen3.5 state is 1 MiB per layer and request); `FlaGdn`
calls flash-linear-attention's Triton kernels (the optional `fla-core` package, extra `hyssm[fla]`).
`gdn_choice` names FlaGdn on CUDA when `fla` imports, else a pure-torch one (logged). All read and
write the recurrent-state pool only at the slots they are given, through `state_codec` (the pool
stores float32, bfloat16 or int8; the rule runs on the decoded float32 state and the result is
encoded once per call); q and k arrive L2-normalised and expanded to one head per value head, q
not yet scaled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.gated_delta import CHUNK_SIZE, gated_delta_chunked, gated_delta_step
from worker_proc.kernels.state_codec import StatePool

logger = logging.getLogger(__name__)


class ReferenceGdn:
    """Pure torch; `chunked`: one prefill segment in chunks of `CHUNK_SIZE`; `step`: one token for
    every decode row, batched."""

    name = "reference"

    def chunked(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                state_pool: StatePool, slot: int) -> Tensor:  # fmt: skip
        o, final = gated_delta_chunked(q, k, v, g, beta, scale, codec.load(state_pool, slot), CHUNK_SIZE)
        codec.store(final, state_pool, slot)
        return o

    def step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
               state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        o, new_state = gated_delta_step(codec.load(state_pool, slots), q, k, v, g, beta, scale)
        codec.store(new_state, state_pool, slots)
        return o


class FastGdn(ReferenceGdn):
    """The reference `chunked`; `step` updates each request's state row in place with batched matrix
    products over the heads: S *= exp(g); u = beta (v - Sᵀk); S += k uᵀ; o = Sᵀ(scale q).
    Not batch invariant by contract (the deterministic mode runs ReferenceGdn). A bfloat16 or int8
    pool is updated the same way on a float32 copy of the group's rows (`state_codec.run_on_float32`)."""

    name = "fast"

    def step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
               state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        if not codec.is_float32(state_pool):
            return codec.run_on_float32(state_pool, slots, partial(self.step, q, k, v, g, beta, scale))
        decay = g.float().exp()[..., None, None]  # [Bt, H, 1, 1]
        kf, qs, vf, bf = k.float()[:, :, None, :], (q.float() * scale)[:, :, None, :], v.float(), beta.float()
        o = torch.empty_like(vf)
        for i, slot in enumerate(slots.tolist()):
            state = state_pool[slot]  # [H, Dk, Dv] view of the pool row
            state.mul_(decay[i])
            u = (vf[i] - torch.bmm(kf[i], state)[:, 0]) * bf[i][:, None]  # [H, Dv]
            state.baddbmm_(kf[i].transpose(1, 2), u[:, None, :])
            torch.bmm(qs[i], state, out=o[i][:, None, :])
        return o


class FlaDeltaRule:
    """A delta rule on flash-linear-attention's kernels (`chunk`: a prefill, `recurrent`: decode steps): q, k and
    v go in the model dtype (v's: bf16 on a bf16 model, fp32 on an fp32 one), g and beta in float32; the kernels
    accumulate in float32 and read and return the float32 [N, H, Dk, Dv] state (decoded from and encoded into the
    pool by `state_codec`)."""

    name = "fla"

    def __init__(self, chunk: Callable[..., tuple[Tensor, Tensor]],
                 recurrent: Callable[..., tuple[Tensor, Tensor]]) -> None:  # fmt: skip
        self._chunk = chunk
        self._recurrent = recurrent

    def chunked(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                state_pool: StatePool, slot: int) -> Tensor:  # fmt: skip
        dt, f = v.dtype, torch.float32
        initial = codec.load(state_pool, slot)[None]
        o, final = self._chunk(q[None].to(dt), k[None].to(dt), v[None], g[None].to(f), beta[None].to(f),
                               scale=scale, initial_state=initial, output_final_state=True)
        codec.store(final[0].float(), state_pool, slot)
        return o[0].float()

    def step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
             state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        dt, f = v.dtype, torch.float32
        o, final = self._recurrent(q[:, None].to(dt), k[:, None].to(dt), v[:, None], g[:, None].to(f),
                                   beta[:, None].to(f), scale=scale, initial_state=codec.load(state_pool, slots),
                                   output_final_state=True)
        codec.store(final.float(), state_pool, slots)
        return o[:, 0].float()


class FlaGdn(FlaDeltaRule):
    """Gated DeltaNet on `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` (a scalar decay per head).
    Raises ImportError without `fla`."""

    def __init__(self) -> None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        super().__init__(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)


def gdn_choice(device: torch.device | str, fast: bool = False) -> str:
    """`fla` on CUDA when flash-linear-attention imports, else a pure-torch backend: `fast` with `fast`
    (the fast CPU kernels' choice), `reference` otherwise."""
    if torch.device(device).type != "cuda":
        return "fast" if fast else "reference"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError as exc:
        logger.info("fla-core not importable (%s): Gated DeltaNet layers use the pure-torch kernels", exc)
        return "reference"
    return "fla"


def make_gdn(name: str) -> ReferenceGdn | FlaGdn:
    """The backend `gdn_choice` named (the native kernel set's own, `NativeGdn`, is made by
    `KernelChoice.build`)."""
    return {"reference": ReferenceGdn, "fast": FastGdn, "fla": FlaGdn}[name]()


class GdnMethods:
    """The `KernelOps` gated-delta methods, delegated to `self.gdn` (a backend above)."""

    gdn: ReferenceGdn | FlaGdn = ReferenceGdn()

    def gdn_prefill(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                    state_pool: StatePool, slot: int) -> Tensor:  # fmt: skip
        return self.gdn.chunked(q, k, v, g, beta, scale, state_pool, slot)

    def gdn_decode(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                   state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        return self.gdn.step(q, k, v, g, beta, scale, state_pool, slots)
