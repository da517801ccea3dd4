"""`LoraSlots`: a rank's adapter slots (`--max-loras-per-batch` of them, 1..max_loras; slot 0 is the base
model) and the rows of the current step that run under each.

The scheduler decides which adapter sits in which slot and sends `LoraLoad(slot, adapter)` in a batch before
any slice of that batch or a later one uses the slot (shared/messages/scheduler_worker.py). A rank reads the
adapter again here (`stage`: the files checked by shared.lora.read_adapter against the served model and this
rank's --max-lora-rank, their digest against the adapter's `uid`, then its tensors), before anything of the
step is written, and replaces the slot's tensors in every layer when the step's state operations run
(`commit`); a load that fails fails the step and leaves the slots as they were. Tensor parallelism: a
layer's A and B are sliced as its base weight is (the model's `shard_spec` of `<layer>.weight`): a
column-parallel layer's B on its output rows (every range of a fused layer's rows), a row-parallel layer's A
on its input columns (worker_proc.lora.layer says how the partial sums meet).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from shared.lora import WEIGHTS_FILE, LoraError, linear_layers, lora_tensor, read_adapter
from shared.messages import LoraLoad
from shared.messages.lora import LoraAdapter
from shared.model_config import HybridConfig
from worker_proc.linear.kernels import GemmKernel
from worker_proc.lora.layer import LoraLayer
from worker_proc.model.hybrid import HybridForCausalLM
from worker_proc.model.layers import Linear
from worker_proc.model.shard import ShardSpec

logger = logging.getLogger(__name__)

LayerPairs = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""Layer name -> this rank's (A [r, in], B [out, r] with the scaling folded in)."""


@dataclass(frozen=True)
class StagedLoad:
    """An adapter read for a slot, not yet in it."""

    slot: int
    adapter: LoraAdapter
    pairs: LayerPairs


def rank_pairs(adapter: LoraAdapter, layers: set[str], spec_of: Callable[[str], ShardSpec | None],
               dtype: torch.dtype, device: torch.device, cfg: HybridConfig) -> LayerPairs:  # fmt: skip
    """This rank's A and B of every layer the adapter changes (its file already checked)."""
    raw: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(os.path.join(adapter.path, WEIGHTS_FILE)).items():
        hit = lora_tensor(key, cfg)
        if hit is None or hit[0] not in layers:
            raise LoraError(f"adapter {adapter.name!r}: tensor {key!r} targets no linear layer of the model")
        raw.setdefault(hit[0], {})[hit[1]] = t
    pairs: LayerPairs = {}
    for name, ab in raw.items():
        a, b = ab["A"].float(), ab["B"].float() * adapter.scaling
        spec = spec_of(f"{name}.weight")
        if spec is not None:
            a, b = (a, spec.apply(b)) if spec.dim == 0 else (spec.apply(a), b)
        pairs[name] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
    return pairs


class LoraSlots:
    """The adapter slots of one rank's model (see the module doc). `groups`: during a forward, each slot's
    rows of the step (a slice for one contiguous run of rows, else an index tensor), `rows` the step's row
    count (0 outside a forward and in a step without adapter rows). `kernel`: the plan's LoRA product;
    `native_rows`: up to how many rows a step takes the native op (`native`, with `row_slot` the slot of every
    row; ExecutionPlan.lora_native_rows, 0: never), `groups` then left empty."""

    def __init__(self, model: HybridForCausalLM, max_loras: int, max_rank: int, kernel: GemmKernel,
                 native_rows: int = 0) -> None:  # fmt: skip
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"LoRA slots need max_loras >= 1 and max_lora_rank >= 1 ({max_loras}, {max_rank})")
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        self.kernel = kernel
        self.native_rows = native_rows
        self.adapters: dict[int, LoraAdapter] = {}
        self.groups: tuple[tuple[int, slice | torch.Tensor], ...] = ()
        self.rows = 0
        self.native = False
        self.row_slot: torch.Tensor | None = None
        wanted = set(linear_layers(model.cfg))
        self.layers: dict[str, LoraLayer] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name in wanted:
                module.lora = self.layers[name] = LoraLayer(self, name, *module.gemm.shape)
        missing = sorted(wanted - set(self.layers))
        if missing:
            raise ValueError(f"the model lacks linear layer {missing[0]} that adapters may target")
        model.lora = self

    @property
    def loaded(self) -> frozenset[int]:
        return frozenset(self.adapters)

    def stage(self, loads: list[LoraLoad]) -> list[StagedLoad]:
        """Every load of a batch read and checked (LoraError / ValueError naming the adapter); nothing changes."""
        staged = []
        model = self.model
        for load in loads:
            if not 1 <= load.slot <= self.max_loras:
                raise ValueError(f"adapter slot {load.slot} outside 1..{self.max_loras} (--max-loras-per-batch)")
            ad = load.adapter
            checked = read_adapter(ad.name, ad.path, model.cfg, self.max_rank)
            if checked.uid != ad.uid:
                raise LoraError(f"adapter {ad.name!r} at {ad.path}: its files changed since it was registered")
            pairs = rank_pairs(ad, set(self.layers), model.shard_spec, model.dtype, model.device, model.cfg)
            staged.append(StagedLoad(load.slot, ad, pairs))
        return staged

    def slots_after(self, staged: list[StagedLoad]) -> frozenset[int]:
        """The slots holding an adapter once `staged` is committed."""
        return self.loaded | {s.slot for s in staged}

    def commit(self, staged: list[StagedLoad]) -> None:
        """Each staged adapter replaces what its slot held, in every layer."""
        for s in staged:
            for layer in self.layers.values():
                layer.drop(s.slot)
            for name, (a, b) in s.pairs.items():
                self.layers[name].put(s.slot, a, b)
            old = self.adapters.get(s.slot)
            self.adapters[s.slot] = s.adapter
            logger.info("adapter slot %d: %s (rank %d, %d layers)%s", s.slot, s.adapter.name, s.adapter.rank,
                        len(s.pairs), f", replacing {old.name}" if old is not None else "")

    def begin(self, lora_rows: tuple[tuple[int, tuple[tuple[int, int], ...]], ...], row_slot: torch.Tensor | None,
              rows: int) -> None:  # fmt: skip
        """The step's rows of each slot (StepBatch.lora_rows, and `row_slot` the slot of each row), until `end`."""
        self.rows = rows
        self.native = row_slot is not None and rows <= self.native_rows
        if self.native:
            self.row_slot = row_slot
            return
        device = self.model.device
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, runs in lora_rows:
            if len(runs) == 1:
                groups.append((slot, slice(*runs[0])))
            else:
                groups.append((slot, torch.cat([torch.arange(a, b, device=device) for a, b in runs])))
        self.groups = tuple(groups)

    def end(self) -> None:
        self.groups, self.rows, self.native, self.row_slot = (), 0, False, None

    def check_integrity(self) -> None:
        for layer in self.layers.values():
            assert set(layer.pairs) <= set(self.adapters), f"{layer.name} holds a slot without an adapter"
            for slot, (a, b) in layer.pairs.items():
                assert layer.name in self.adapters[slot].targets
                assert (b.shape[0], a.shape[1]) == layer.shape and a.shape[0] == self.adapters[slot].rank
            assert (layer.packed is None) == (not layer.pairs), f"{layer.name}: packed out of step with its slots"
            if layer.packed is not None:
                a, bt, cols = layer.packed
                for slot, (sa, sb) in layer.pairs.items():
                    lo, hi = cols[slot].tolist()
                    assert torch.equal(a[lo:hi], sa) and torch.equal(bt[lo:hi], sb.t()), f"{layer.name} slot {slot}"
                assert sum(int(hi - lo) for lo, hi in cols.tolist()) == a.shape[0] == bt.shape[0]
