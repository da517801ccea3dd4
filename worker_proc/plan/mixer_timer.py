"""How the execution plan times a step's recurrent kernels on this machine (`MixerTimer`).

The thread count of a step decides the speed of its products and of its Mamba layers' conv and scan
kernels alike, and the two can prefer different counts (a prefill's products may run as fast on one
core while its scan runs twice as fast on two). So the plan adds, per row bucket and thread count,
the time of one step's Mamba kernels to that of its products (worker_proc.plan.execution_plan.choose):
for r <= `DECODE_ROWS` rows, r requests decoding one token each (`mamba_decode`); above, one prefill
segment of r tokens (`conv_prefill_many` and `ssd_prefill_many`); one layer on scratch pools of the
layer's own shapes and the kernel set's own ops, times the model's Mamba layers. Each figure is the
fastest of `reps` rounds after an untimed one, under the process's allocator policy (as
`product_timer.ProductTimer`). Gated DeltaNet and attention kernels are not timed.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from worker_proc.kernels import KernelOps
from worker_proc.model.mamba import MambaMixer
from worker_proc.plan.tuning import DECODE_ROWS


class MixerTimer:
    """(rows, threads) -> seconds of one step's Mamba kernels over the whole model (0 without Mamba layers)."""

    def __init__(self, model: nn.Module, ops: KernelOps, reps: int = 3) -> None:
        mixers = [m for m in model.modules() if isinstance(m, MambaMixer)]
        self.layer = mixers[0] if mixers else None
        self.layers = len(mixers)
        self.ops = ops
        self.reps = reps

    def __call__(self, rows: int, threads: int) -> float:
        if self.layer is None:
            return 0.0
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            run = self._decode(rows) if rows <= DECODE_ROWS else self._prefill(rows)
            best = float("inf")
            run()
            for _ in range(self.reps):
                t0 = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t0)
        finally:
            torch.set_num_threads(before)
        return best * self.layers

    def _pools(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.layer
        assert m is not None
        s, weight = m.shard, m.conv1d.weight
        conv = torch.zeros(slots + 1, s.conv_dim, weight.shape[-1] - 1, dtype=weight.dtype, device=weight.device)
        ssm = torch.zeros(slots + 1, s.heads, s.d_head, s.d_state, dtype=torch.float32, device=weight.device)
        return conv, ssm

    def _inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.layer
        assert m is not None
        weight = m.conv1d.weight
        xbc = torch.randn(rows, m.shard.conv_dim, device=weight.device).to(weight.dtype)
        dt = torch.randn(rows, m.shard.heads, device=weight.device).to(weight.dtype)
        return xbc, dt

    def _decode(self, rows: int):  # type: ignore[no-untyped-def]
        m = self.layer
        assert m is not None
        conv, ssm = self._pools(rows)
        inputs = self._inputs(rows)
        slots = torch.arange(1, rows + 1, device=conv.device)
        return lambda: m.recur_decode(inputs, None, slots, conv, ssm, self.ops)

    def _prefill(self, rows: int):  # type: ignore[no-untyped-def]
        m = self.layer
        assert m is not None
        conv, ssm = self._pools(1)
        inputs = self._inputs(rows)
        return lambda: m.recur_prefill(inputs, ((rows, 1),), conv, ssm, self.ops)
