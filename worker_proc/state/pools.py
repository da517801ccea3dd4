"""`StatePools`: the worker's attention KV pool and the recurrent-state pools of every layer kind.

One instance per worker rank. The scheduler owns every slot *number*: it decides
which slots a request uses, and the worker only reads/writes the tensors at those slots. Slot 0 of
every pool is padding: never handed out, never written, always zero (checked by check_integrity).

Layout (S = capacity + 1; head and channel counts are this rank's, see worker_proc.model.tp:
kv_heads / tp or 1 replicated KV head, heads / tp, conv channels of the rank's heads and groups):
  k    : [attn_layers,  S_kv,    kv_heads, head_dim]            model dtype
  v    : [attn_layers,  S_kv,    kv_heads, kv_value_dim]        model dtype
(`kv_value_dim` is head_dim, or 0 for an MLA model: its layers read the cached latent row, K, as V too,
so V costs nothing and one KV token slot is K alone; `kv_pools` are the pools that hold channels)
and one tensor [layers of the kind, S_state, *shape] per `StateTensor` a recurrent layer kind
declares (`state_tensors`):
  conv      : Mamba   [conv_dim, d_conv - 1]              model dtype
  ssm       : Mamba   [heads, head_dim, d_state]          the state dtype
  ssm_scale : Mamba   [heads, head_dim]                   float32, int8 state only
  gdn_conv  : GDN     [2 * k_heads * k_dim + v_heads * v_dim, d_conv - 1]   model dtype
  gdn_state : GDN     [v_heads, k_dim, v_dim]             the state dtype
  gdn_state_scale : GDN [v_heads, k_dim]                 float32, int8 state only
  short_conv_window : short conv [hidden, d_conv - 1]    model dtype (the whole state of the kind)
  kda_conv  : KDA     [3 * heads * head_dim, d_conv - 1]  model dtype (q | k | v channels)
  kda_state : KDA     [heads, head_dim, head_dim]         the state dtype
  kda_state_scale : KDA [heads, head_dim]                float32, int8 state only
  mamba1_conv : Mamba1 [d_inner, d_conv - 1]              model dtype
  mamba1_ssm  : Mamba1 [d_inner, d_state]                 the state dtype (one state per channel)
  mamba1_ssm_scale : Mamba1 [d_inner]                     float32, int8 state only
The state dtype (`--mamba-ssm-dtype`: float32, bfloat16 or int8; worker_proc.kernels.state_codec owns
the encodings) decides how the recurrent states are stored, never how they are computed; an int8
state keeps one scale per (slot, layer, head, row) in its `*_scale` tensor (Mamba1: per channel), and
`state_pool` hands the kernels the values and scales of a layer together. One state slot (a request's, a checkpoint's, a
cached prefix's) is the same slot number in every one of them: `copy_state` / `clear_state` move
every tensor of the slot (values and scales alike) of every layer of every kind at once, and a slot
costs the sum of all of them (`slot_bytes`, scales included), so a narrower state dtype gives more
slots in the same budget. Capacities are planned per rank from the rank's own slot sizes; the
scheduler uses the minimum. A model without attention layers allocates no KV memory
(attention_layers = 0) and a model without recurrent layers no state memory; see
`attention_free_kv_slots` for the token slots the former reports.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

from shared.model_config import HybridConfig
from worker_proc.host.memory import zeros
from worker_proc.kernels.state_codec import QuantizedPool, StatePool, storage_dtype
from worker_proc.model.tp import AttnShard, GdnShard, MambaShard

logger = logging.getLogger(__name__)

# The pools' memory on CPU when --mem-budget-gb is 0: at least this (the tests' and the built-in
# model's workloads), more when the running requests' states need it (see `pool_budget`).
DEFAULT_CPU_BUDGET_BYTES = 256 << 20
CPU_MAX_RAM_FRACTION = 0.25
"""The CPU default never takes more than this share of the RAM available at start-up."""


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); the physical memory elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a recurrent layer kind's state: `layers` of them, `shape` per slot and layer."""

    name: str
    layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def slot_bytes(self) -> int:
        return self.layers * math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


SCALE_SUFFIX = "_scale"
"""An int8 state tensor NAME keeps its per-row scales in the state tensor NAME + SCALE_SUFFIX."""


def _recurrent(name: str, layers: int, shape: tuple[int, ...], state_dtype: str) -> list[StateTensor]:
    """A recurrent state [..., b] ([heads, a, b], or Mamba1's [channels, b]) stored as `state_dtype`, and
    its per-row scales [...] (one per row of b values) when int8."""
    storage = storage_dtype(state_dtype)
    out = [StateTensor(name, layers, shape, storage)]
    if storage == torch.int8:
        out.append(StateTensor(name + SCALE_SUFFIX, layers, shape[:-1], torch.float32))
    return out


def mamba_state_tensors(cfg: HybridConfig, dtype: torch.dtype, tp_size: int, tp_rank: int,
                        state_dtype: str = "float32") -> list[StateTensor]:  # fmt: skip
    """Mamba2: the conv window (model dtype) and the SSM state (`state_dtype`, with `ssm_scale` when
    int8). Always declared (a model without Mamba layers has zero of them), as `pools.conv` /
    `pools.ssm` are always there."""
    n, m = len(cfg.mamba_layer_ids), MambaShard.of(cfg, tp_rank, tp_size)
    return [StateTensor("conv", n, (m.conv_dim, max(cfg.mamba.d_conv - 1, 0)), dtype),
            *_recurrent("ssm", n, (m.heads, cfg.mamba.d_head, cfg.mamba.d_state), state_dtype)]


def gdn_state_tensors(cfg: HybridConfig, dtype: torch.dtype, tp_size: int, tp_rank: int,
                      state_dtype: str = "float32") -> list[StateTensor]:  # fmt: skip
    """Gated DeltaNet: the conv window over q | k | v (model dtype) and the [Hv, Dk, Dv] recurrent
    state (`state_dtype`, with `gdn_state_scale` when int8); declared only when the model has such layers."""
    n = len(cfg.gdn_layer_ids)
    if not n:
        return []
    g = GdnShard.of(cfg, tp_rank, tp_size)
    return [StateTensor("gdn_conv", n, (g.conv_dim, cfg.gdn.d_conv - 1), dtype),
            *_recurrent("gdn_state", n, (g.v_heads, cfg.gdn.k_dim, cfg.gdn.v_dim), state_dtype)]


def short_conv_state_tensors(cfg: HybridConfig, dtype: torch.dtype, tp_size: int, tp_rank: int,
                             state_dtype: str = "float32") -> list[StateTensor]:  # fmt: skip
    """Gated short convolutions (LFM2): the conv window over this rank's hidden channels (model dtype)
    and nothing else, so `--mamba-ssm-dtype` does not apply; declared only when the model has such layers."""
    n = len(cfg.short_conv_layer_ids)
    if not n:
        return []
    return [StateTensor("short_conv_window", n, (cfg.hidden_size // tp_size, cfg.short_conv.d_conv - 1), dtype)]


def kda_state_tensors(cfg: HybridConfig, dtype: torch.dtype, tp_size: int, tp_rank: int,
                      state_dtype: str = "float32") -> list[StateTensor]:  # fmt: skip
    """Kimi Delta Attention: the conv windows over this rank's q | k | v channels (model dtype) and the
    [heads, head_dim, head_dim] recurrent state of its heads (`state_dtype`, with `kda_state_scale` when
    int8); declared only when the model has such layers."""
    n = len(cfg.kda_layer_ids)
    if not n:
        return []
    heads, d = cfg.kda.heads // tp_size, cfg.kda.head_dim
    return [StateTensor("kda_conv", n, (3 * heads * d, cfg.kda.d_conv - 1), dtype),
            *_recurrent("kda_state", n, (heads, d, d), state_dtype)]


def mamba1_state_tensors(cfg: HybridConfig, dtype: torch.dtype, tp_size: int, tp_rank: int,
                         state_dtype: str = "float32") -> list[StateTensor]:  # fmt: skip
    """Mamba1 (selective scan): the conv window over this rank's d_inner channels (model dtype) and each
    channel's [d_state] SSM state (`state_dtype`, with `mamba1_ssm_scale` when int8); declared only when
    the model has such layers."""
    n = len(cfg.mamba1_layer_ids)
    if not n:
        return []
    width = cfg.mamba1.d_inner // tp_size
    return [StateTensor("mamba1_conv", n, (width, cfg.mamba1.d_conv - 1), dtype),
            *_recurrent("mamba1_ssm", n, (width, cfg.mamba1.d_state), state_dtype)]


STATE_KINDS = (mamba_state_tensors, gdn_state_tensors, short_conv_state_tensors, kda_state_tensors,
               mamba1_state_tensors)
"""Every recurrent layer kind's declaration of its state tensors."""
MIXER_STATES: dict[str, tuple[str, str | None]] = {
    "mamba": ("conv", "ssm"), "gdn": ("gdn_conv", "gdn_state"), "short_conv": ("short_conv_window", None),
    "kda": ("kda_conv", "kda_state"), "mamba1": ("mamba1_conv", "mamba1_ssm")}
"""Each recurrent mixer kind's (conv window, recurrent state) tensors of `STATE_KINDS` (None: the kind's
state is its conv window alone)."""


def state_tensors(cfg: HybridConfig, dtype: torch.dtype, tp_size: int = 1, tp_rank: int = 0,
                  state_dtype: str = "float32") -> list[StateTensor]:  # fmt: skip
    """The tensors one state slot holds on this rank, every recurrent layer kind's."""
    return [t for kind in STATE_KINDS for t in kind(cfg, dtype, tp_size, tp_rank, state_dtype)]


@dataclass(frozen=True)
class SlotBytes:
    """Bytes one slot costs across all layers."""

    kv_token: int  # one KV token slot (K and V of every attention layer; K alone for MLA, whose V is K)
    state_slot: int  # one state slot: every recurrent layer's state tensors (every recurrent kind)


def slot_bytes(cfg: HybridConfig, dtype: torch.dtype, tp_size: int = 1, tp_rank: int = 0,
               state_dtype: str = "float32", extra_kv_layers: int = 0) -> SlotBytes:  # fmt: skip
    """What `StatePools` allocates per slot on this rank: KV in the model dtype, every state tensor
    (recurrent states in `state_dtype`, their scales) of one state slot; `extra_kv_layers` more
    attention layers' KV per token slot (the MTP layers', worker_proc.spec.mtp_drafting, K and V both)."""
    elt = torch.empty((), dtype=dtype).element_size()
    attn = AttnShard.of(cfg, tp_rank, tp_size)
    row = attn.kv_heads * elt  # bytes per channel of one layer's token slot
    kv = len(cfg.attn_layer_ids) * (cfg.attn.head_dim + cfg.kv_value_dim) * row
    kv += extra_kv_layers * 2 * cfg.attn.head_dim * row
    state = sum(t.slot_bytes for t in state_tensors(cfg, dtype, tp_size, tp_rank, state_dtype))
    return SlotBytes(kv_token=kv, state_slot=state)


def pool_budget(
    device: torch.device, explicit_bytes: int, mem_fraction_static: float, cpu_wanted_bytes: int = 0
) -> tuple[int, str]:
    """The bytes one rank's KV + Mamba state pools may take, and a phrase saying how it was set.

    - `explicit_bytes` > 0 (`--mem-budget-gb`): exactly that, on any device;
    - CUDA: `--mem-fraction-static` as in SGLang, measured once the weights are loaded: weights
      and pools together take at most that fraction of the device's total memory, so the pools
      get `free - total * (1 - fraction)`; the rest stays for activations and other processes;
    - CPU: `cpu_wanted_bytes` (what the running requests' states need, from the caller) but at
      least `DEFAULT_CPU_BUDGET_BYTES` and at most `CPU_MAX_RAM_FRACTION` of the available RAM.
    Raises ValueError when the CUDA rule leaves no memory for the pools.
    """
    if explicit_bytes > 0:
        return explicit_bytes, "--mem-budget-gb"
    if device.type != "cuda":
        cap = int(available_ram_bytes() * CPU_MAX_RAM_FRACTION)
        if cpu_wanted_bytes <= DEFAULT_CPU_BUDGET_BYTES or cap <= DEFAULT_CPU_BUDGET_BYTES:
            return DEFAULT_CPU_BUDGET_BYTES, "the CPU default"
        if cpu_wanted_bytes <= cap:
            return cpu_wanted_bytes, "the CPU default sized for --max-running-requests"
        return cap, f"the CPU default capped at {CPU_MAX_RAM_FRACTION:.0%} of the available RAM"
    free, total = torch.cuda.mem_get_info(device)
    budget = int(free - total * (1.0 - mem_fraction_static))
    if budget <= 0:
        raise ValueError(
            f"--mem-fraction-static {mem_fraction_static} leaves no memory for the KV and state pools on {device}: "
            f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB after loading the weights; raise it or give "
            "--mem-budget-gb"
        )
    return budget, f"--mem-fraction-static {mem_fraction_static} of {total / 2**30:.2f} GiB"


def cpu_wanted_budget(cfg: HybridConfig, dtype: torch.dtype, running: int, state_ratio: float,
                      tp_size: int = 1, tp_rank: int = 0, state_dtype: str = "float32") -> int:
    """Pool bytes that give `running` requests a state slot each plus a quarter more for cached
    prefix states and checkpoints, with KV in the `state_ratio` split (0 for a model without
    recurrent layers)."""
    if not cfg.state_layer_ids:
        return 0
    states = running + running // 4 + 2
    return int(states * slot_bytes(cfg, dtype, tp_size, tp_rank, state_dtype).state_slot / state_ratio)


def plan_capacities(
    cfg: HybridConfig, budget_bytes: int, state_ratio: float, dtype: torch.dtype, tp_size: int = 1,
    tp_rank: int = 0, state_dtype: str = "float32", extra_kv_layers: int = 0,
) -> tuple[int, int]:
    """Split `budget_bytes` into (kv_slots, state_slots), usable counts excluding padding slot 0.

    `state_ratio` is the fraction of the budget given to the state pools (the rest to KV); a model
    without recurrent layers (or without attention) gives the whole budget to the other pool.
    Raises ValueError when the budget cannot hold one usable slot of each pool the model needs.
    """
    if not 0.0 < state_ratio < 1.0:
        raise ValueError(f"state_ratio must be in (0, 1), got {state_ratio}")
    sb = slot_bytes(cfg, dtype, tp_size, tp_rank, state_dtype, extra_kv_layers)
    if sb.state_slot == 0:
        state_ratio = 0.0
    elif sb.kv_token == 0:
        state_ratio = 1.0
    kv_slots = int(budget_bytes * (1.0 - state_ratio)) // sb.kv_token - 1 if sb.kv_token else 0
    state_slots = int(budget_bytes * state_ratio) // sb.state_slot - 1 if sb.state_slot else 0
    if (sb.kv_token and kv_slots < 1) or (sb.state_slot and state_slots < 1):
        raise ValueError(
            f"memory budget {budget_bytes} B too small: {sb.kv_token} B per KV token, "
            f"{sb.state_slot} B per recurrent state slot, ratio {state_ratio}"
        )
    return max(kv_slots, 0), max(state_slots, 0)


ATTENTION_FREE_MAX_TOKENS = 1 << 20


def attention_free_kv_slots(requested: int, state_slots: int, context: int) -> int:
    """The token slots a model without attention layers reports. Its KV pool has no tensor at all
    (zero bytes per slot), so the slots are only the scheduler's token bookkeeping (the radix tree
    keeps one per cached token): `requested` (--max-total-tokens) when given, else enough for every
    state slot to hold a full context, capped at ATTENTION_FREE_MAX_TOKENS (bounding the scheduler's
    tree), and never less than one context."""
    if requested > 0:
        return requested
    return max(context, min(state_slots * context, ATTENTION_FREE_MAX_TOKENS))


class StatePools:
    """KV and recurrent state tensors of one worker rank. See the module docstring for layout."""

    def __init__(
        self,
        cfg: HybridConfig,
        kv_slots: int,
        state_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_size: int = 1,
        tp_rank: int = 0,
        state_dtype: str = "float32",
    ) -> None:
        if kv_slots < 0 or state_slots < 0:
            raise ValueError("pool capacities must be >= 0")
        self.kv_capacity = kv_slots
        self.state_capacity = state_slots
        self.dtype = dtype
        self.state_dtype = state_dtype
        self.state_storage = storage_dtype(state_dtype)
        n_attn = len(cfg.attn_layer_ids)
        attn = AttnShard.of(cfg, tp_rank, tp_size)
        kv_shape = (n_attn, kv_slots + 1, attn.kv_heads)
        self.k = zeros((*kv_shape, cfg.attn.head_dim), dtype, device)
        self.v = zeros((*kv_shape, cfg.kv_value_dim), dtype, device)
        self.layout = tuple(state_tensors(cfg, dtype, tp_size, tp_rank, state_dtype))
        self.states: dict[str, torch.Tensor] = {
            t.name: zeros((t.layers, state_slots + 1, *t.shape), t.dtype, device)
            for t in self.layout
        }
        logger.info(
            "state pools: %d KV token slots (%d attention layers), %d state slots (%d recurrent layers: %s; "
            "state dtype %s, %d B per state slot), %.1f MiB at most (resident as slots are first written)",
            kv_slots, n_attn, state_slots, len(cfg.state_layer_ids),
            ", ".join(f"{t.name} {t.layers}x{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                      for t in self.layout if t.layers),
            state_dtype, sum(t.slot_bytes for t in self.layout), self.nbytes() / 2**20,
        )

    @property
    def conv(self) -> torch.Tensor:
        """Mamba conv windows [mamba_layers, S, conv_dim, d_conv - 1]."""
        return self.states["conv"]

    @property
    def ssm(self) -> torch.Tensor:
        """Mamba SSM states [mamba_layers, S, heads, head_dim, d_state] in the state storage dtype
        (int8: the values; their scales are `states["ssm_scale"]`)."""
        return self.states["ssm"]

    def layer_state(self, kind: str, layer: int) -> tuple[torch.Tensor, StatePool | None]:
        """One recurrent layer's pools, the same way for every recurrent mixer kind (`MIXER_STATES`):
        its conv windows [S, C, K-1] and its recurrent state (`state_pool`; None for a kind whose state
        is the conv window alone); `layer` is its index among the layers of its kind."""
        conv, state = MIXER_STATES[kind]
        return self.states[conv][layer], None if state is None else self.state_pool(state, layer)

    def state_pool(self, name: str, layer: int) -> StatePool:
        """The kernels' view of recurrent state `name` ("ssm", "gdn_state", "mamba1_ssm") of one layer (its index
        among the layers of its kind): the [S, ...] tensor, or with an int8 state its values and
        scales together."""
        values = self.states[name][layer]
        if self.state_storage != torch.int8:
            return values
        return QuantizedPool(values, self.states[name + SCALE_SUFFIX][layer])

    @property
    def kv_pools(self) -> tuple[torch.Tensor, ...]:
        """The KV pools that hold channels, in the order a stored KV block lists them: (k, v), or (k,)
        when V has none (MLA)."""
        return (self.k, self.v) if self.v.shape[-1] else (self.k,)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, *self.states.values()))

    def _check_state_slot(self, slot: int, what: str) -> None:
        if not 1 <= slot <= self.state_capacity:
            raise ValueError(f"{what} state slot {slot} outside [1, {self.state_capacity}]")  # the state slot

    def copy_state(self, src: int, dst: int) -> None:
        """Copy the recurrent state (every tensor of every recurrent layer) of slot `src` into `dst`."""
        self._check_state_slot(src, "source")
        self._check_state_slot(dst, "destination")
        if src == dst:
            return
        for pool in self.states.values():
            pool[:, dst].copy_(pool[:, src])

    def clear_state(self, slot: int) -> None:
        """Zero the recurrent state of `slot` (a fresh request starts from zeros)."""
        self._check_state_slot(slot, "cleared")
        for pool in self.states.values():
            pool[:, slot].zero_()

    def check_integrity(self) -> None:
        """Raise AssertionError if shapes/dtypes are off or padding slot 0 was ever written."""
        assert self.k.shape[:-1] == self.v.shape[:-1] and self.k.shape[1] == self.kv_capacity + 1
        assert self.v.shape[-1] in (0, self.k.shape[-1]) and self.v.dtype == self.dtype
        assert self.k.dtype == self.dtype
        for t in self.layout:
            pool = self.states[t.name]
            assert pool.shape == (t.layers, self.state_capacity + 1, *t.shape), f"{t.name} pool shape {pool.shape}"
            assert pool.dtype == t.dtype, f"{t.name} pool dtype {pool.dtype}"
        assert self.ssm.dtype == self.state_storage and self.conv.dtype == self.dtype
        for name, pool in (("k", self.k), ("v", self.v), *self.states.items()):
            assert not torch.any(pool[:, 0] != 0), f"padding slot 0 of the {name} pool was written"
