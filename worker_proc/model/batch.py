"""`StepBatch`: one step's requests flattened into tensors the model consumes.

Built from `ReqSlice`s (see shared/messages.py for their meaning);
all requests' new tokens are concatenated into one token dimension (rows) so projections and MLPs
run once per step. Requests with exactly one new token form the *decode group* (one batched state
update and attention per layer); the others form the *prefill group* (every mixer hands all of its
segments to one `*_prefill_many` call, which a kernel set may batch). `by_group` is the one dispatch
of a step's rows onto the two groups that every mixer uses.
Validation here is what protects the pools from a malformed batch: every slot is range-checked when
it arrives (slots reused through `KVSlotMirror` were checked in the batch that sent them). Per-request
slot lists are tensors end to end: the mirror's prefix and the new slots are concatenated on the device
and the decode index is padded by copies, never through a Python list of every slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from shared.messages import ReqSlice
from worker_proc.model.kv_mirror import KVSlotMirror

GroupFn = Callable[[torch.Tensor | None], torch.Tensor]
"""A mixer's computation for one group of a step's rows (see `StepBatch.by_group`)."""


def rows_of(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`t`'s rows of one group (all of `t` for None)."""
    return t if rows is None else t[rows]


@dataclass(frozen=True)
class PrefillSeg:
    """One request with more than one new token: rows [row_start, row_end) of the step."""

    row_start: int
    row_end: int
    start_pos: int
    kv_idx: torch.Tensor  # [start_pos + L] int64, KV slot of every position so far
    state_slot: int


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of every row
    new_kv_slots: torch.Tensor  # [T] int64, KV slot each row writes
    prefill: tuple[PrefillSeg, ...]
    dec_rows: torch.Tensor  # [Bt] int64 rows of the decode group
    dec_state_slots: torch.Tensor  # [Bt] int64
    dec_kv_idx: torch.Tensor  # [Bt, Tmax] int64, padded with slot 0
    dec_kv_len: torch.Tensor  # [Bt] int64
    logit_rows: torch.Tensor  # [R] int64 rows whose logits are wanted
    logit_rids: tuple[str, ...]  # request id of each logit row
    kv_full: tuple[torch.Tensor, ...] = ()  # full KV slot list of each request, in slice order

    @cached_property
    def prefill_spans(self) -> tuple[tuple[int, int], ...]:
        """(length, state slot) of each prefill segment, in row order (worker_proc.kernels.segments)."""
        return tuple((seg.row_end - seg.row_start, seg.state_slot) for seg in self.prefill)

    @cached_property
    def prefill_rows(self) -> torch.Tensor | None:
        """The prefill segments' rows, concatenated in order; None when they are every row of the step."""
        if not self.dec_rows.numel():
            return None
        rows = [torch.arange(seg.row_start, seg.row_end) for seg in self.prefill]
        return torch.cat(rows).to(self.dec_rows.device)

    @cached_property
    def prefill_attn_spans(self) -> tuple[tuple[int, int, torch.Tensor], ...]:
        """(length, start_pos, kv_idx) of each prefill segment, in row order (attention's spans)."""
        return tuple((seg.row_end - seg.row_start, seg.start_pos, seg.kv_idx) for seg in self.prefill)

    def by_group(self, decode: GroupFn, prefill: GroupFn) -> torch.Tensor:
        """A mixer's output over the step: `decode(rows)` computes the decode group's rows and
        `prefill(rows)` every prefill segment's at once (rows: that group's rows of the step, in order;
        None when the group is the whole step and its inputs are taken whole). A step with both
        groups writes each group's rows of one output."""
        if self.decode_only:
            return decode(None)
        if not self.dec_rows.numel():
            return prefill(None)
        dec = decode(self.dec_rows)
        pre = prefill(self.prefill_rows)
        out = dec.new_empty((dec.shape[0] + pre.shape[0], *dec.shape[1:]))
        out[self.dec_rows] = dec
        out[self.prefill_rows] = pre
        return out

    @property
    def decode_only(self) -> bool:
        """Every row is the one new token of a decode-group request (then dec_rows == arange(T))."""
        return not self.prefill and self.dec_rows.numel() > 0


def build_step_batch(
    reqs: list[ReqSlice],
    device: torch.device,
    kv_capacity: int,
    state_capacity: int,
    has_recurrent_state: bool,
    all_rows: bool = False,
    uses_attention: bool = True,
    mirror: KVSlotMirror | None = None,
    step: int = 0,
) -> StepBatch:
    """Flatten and validate `reqs` (batch number `step`). Raises ValueError on a malformed slice (slot
    out of range, wrong kv_slots length, duplicate rid or state slot, a kv_reuse the mirror cannot
    serve); nothing is written either way (the caller commits `kv_full` to the mirror after the step
    ran). Without `mirror` every slice must carry its full slot list (kv_reuse == 0). `all_rows`: want
    logits for every row of every request (tests), instead of the last row of each slice with sample;
    a slice with prompt_logprobs >= 0 gets every row too (its last one is its sampling row)."""
    source = mirror if mirror is not None else KVSlotMirror()
    kv_full = source.resolve(reqs, step, device, kv_capacity if uses_attention else 0)
    ids: list[int] = []
    positions: list[int] = []
    new_parts: list[torch.Tensor] = []
    segs: list[PrefillSeg] = []
    dec_rows: list[int] = []
    dec_mamba: list[int] = []
    dec_kv: list[torch.Tensor] = []
    logit_rows: list[int] = []
    logit_rids: list[str] = []
    for r, kv in zip(reqs, kv_full, strict=True):
        n = len(r.input_ids)
        row = len(ids)
        ids.extend(r.input_ids)
        positions.extend(range(r.start_pos, r.start_pos + n))
        new_parts.append(kv[r.start_pos :])
        if n == 1:
            dec_rows.append(row)
            dec_mamba.append(r.state_slot)
            dec_kv.append(kv)
        else:
            segs.append(PrefillSeg(row, row + n, r.start_pos, kv, r.state_slot))
        if all_rows or r.prompt_logprobs >= 0:  # every row: tests, and prompt logprobs
            logit_rows.extend(range(row, row + n))
            logit_rids.extend([r.rid] * n)
        elif r.sample:
            logit_rows.append(row + n - 1)
            logit_rids.append(r.rid)
    if has_recurrent_state:
        _check_state_slots([r.state_slot for r in reqs], state_capacity)

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return StepBatch(
        input_ids=t(ids),
        positions=t(positions),
        new_kv_slots=torch.cat(new_parts) if new_parts else empty,
        prefill=tuple(segs),
        dec_rows=t(dec_rows),
        dec_state_slots=t(dec_mamba),
        dec_kv_idx=_pad_rows(dec_kv, device),
        dec_kv_len=t([int(kv.shape[0]) for kv in dec_kv]),
        logit_rows=t(logit_rows),
        logit_rids=tuple(logit_rids),
        kv_full=tuple(kv_full),
    )


def _pad_rows(rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[len(rows), longest] int64, row i = rows[i] then slot 0 (preallocated, one copy per row)."""
    if not rows:
        return torch.zeros(0, 0, dtype=torch.int64, device=device)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)


def _check_state_slots(slots: list[int], capacity: int) -> None:
    if len(set(slots)) != len(slots):
        raise ValueError(f"duplicate state slots in one batch: {sorted(slots)}")
    bad = [s for s in slots if not 1 <= s <= capacity]
    if bad:
        raise ValueError(f"state slots {bad} outside [1, {capacity}]")
