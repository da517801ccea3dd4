"""`StepBatch`: one step's requests flattened into tensors the model consumes.

Owned by the worker runtime. Built from `ReqSlice`s (see shared/messages.py for their meaning);
all requests' new tokens are concatenated into one token dimension (rows) so projections and MLPs
run once per step. Requests with exactly one new token form the *decode group* (batched Mamba
state update and attention); the others form the *prefill group* (one scan/attention each).
Validation here is what protects the pools from a malformed batch: every slot is range-checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.messages import ReqSlice


@dataclass(frozen=True)
class PrefillSeg:
    """One request with more than one new token: rows [row_start, row_end) of the step."""

    row_start: int
    row_end: int
    start_pos: int
    kv_idx: torch.Tensor  # [start_pos + L] int64, KV slot of every position so far
    mamba_slot: int


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of every row
    new_kv_slots: torch.Tensor  # [T] int64, KV slot each row writes
    prefill: tuple[PrefillSeg, ...]
    dec_rows: torch.Tensor  # [Bt] int64 rows of the decode group
    dec_mamba_slots: torch.Tensor  # [Bt] int64
    dec_kv_idx: torch.Tensor  # [Bt, Tmax] int64, padded with slot 0
    dec_kv_len: torch.Tensor  # [Bt] int64
    logit_rows: torch.Tensor  # [R] int64 rows whose logits are wanted
    logit_rids: tuple[str, ...]  # request id of each logit row

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_step_batch(
    reqs: list[ReqSlice],
    device: torch.device,
    kv_capacity: int,
    mamba_capacity: int,
    uses_mamba: bool,
    all_rows: bool = False,
    uses_attention: bool = True,
) -> StepBatch:
    """Flatten and validate `reqs`. Raises ValueError on a malformed slice (slot out of range,
    wrong kv_slots length, duplicate rid or Mamba slot). `all_rows`: want logits for every row of
    every request (tests), instead of the last row of each slice with sample=True."""
    ids: list[int] = []
    positions: list[int] = []
    new_slots: list[int] = []
    segs: list[tuple[int, int, int, list[int], int]] = []
    dec_rows: list[int] = []
    dec_mamba: list[int] = []
    dec_kv: list[list[int]] = []
    logit_rows: list[int] = []
    logit_rids: list[str] = []
    seen_rids: set[str] = set()
    for r in reqs:
        n = len(r.input_ids)
        if n == 0:
            raise ValueError(f"request {r.rid}: empty input_ids")
        if r.rid in seen_rids:
            raise ValueError(f"request {r.rid} appears twice in one batch")
        seen_rids.add(r.rid)
        if r.start_pos < 0 or len(r.kv_slots) != r.start_pos + n:
            raise ValueError(
                f"request {r.rid}: {len(r.kv_slots)} kv_slots for start_pos {r.start_pos} + {n} tokens"
            )
        row = len(ids)
        ids.extend(r.input_ids)
        positions.extend(range(r.start_pos, r.start_pos + n))
        new_slots.extend(r.kv_slots[r.start_pos :])
        if n == 1:
            dec_rows.append(row)
            dec_mamba.append(r.mamba_slot)
            dec_kv.append(r.kv_slots)
        else:
            segs.append((row, row + n, r.start_pos, r.kv_slots, r.mamba_slot))
        if all_rows:
            logit_rows.extend(range(row, row + n))
            logit_rids.extend([r.rid] * n)
        elif r.sample:
            logit_rows.append(row + n - 1)
            logit_rids.append(r.rid)
    if uses_mamba:
        _check_mamba_slots([r.mamba_slot for r in reqs], mamba_capacity)
    if uses_attention:
        _check_kv_slots(reqs, kv_capacity)
    return _to_tensors(ids, positions, new_slots, segs, dec_rows, dec_mamba, dec_kv, logit_rows, logit_rids, device)


def _check_mamba_slots(slots: list[int], capacity: int) -> None:
    if len(set(slots)) != len(slots):
        raise ValueError(f"duplicate Mamba slots in one batch: {sorted(slots)}")
    bad = [s for s in slots if not 1 <= s <= capacity]
    if bad:
        raise ValueError(f"Mamba slots {bad} outside [1, {capacity}]")


def _check_kv_slots(reqs: list[ReqSlice], capacity: int) -> None:
    for r in reqs:
        if r.kv_slots and (min(r.kv_slots) < 1 or max(r.kv_slots) > capacity):
            raise ValueError(f"request {r.rid}: KV slot outside [1, {capacity}]")


def _to_tensors(
    ids: list[int],
    positions: list[int],
    new_slots: list[int],
    segs: list[tuple[int, int, int, list[int], int]],
    dec_rows: list[int],
    dec_mamba: list[int],
    dec_kv: list[list[int]],
    logit_rows: list[int],
    logit_rids: list[str],
    device: torch.device,
) -> StepBatch:
    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    width = max((len(kv) for kv in dec_kv), default=0)
    padded = [kv + [0] * (width - len(kv)) for kv in dec_kv]
    return StepBatch(
        input_ids=t(ids),
        positions=t(positions),
        new_kv_slots=t(new_slots),
        prefill=tuple(PrefillSeg(s, e, p, t(kv), m) for s, e, p, kv, m in segs),
        dec_rows=t(dec_rows),
        dec_mamba_slots=t(dec_mamba),
        dec_kv_idx=torch.tensor(padded, dtype=torch.int64, device=device).view(len(dec_kv), width),
        dec_kv_len=t([len(kv) for kv in dec_kv]),
        logit_rows=t(logit_rows),
        logit_rids=tuple(logit_rids),
    )
