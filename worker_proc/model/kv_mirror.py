"""`KVSlotMirror`: the worker's copy of each request's KV slot list from the last batch it ran.

One per `ModelRunner`, so one per tensor-parallel rank. The scheduler
owns every slot number; this only mirrors what it sent, so that a `ReqSlice` with `kv_reuse > 0` can
ship the new slots alone (see shared/messages.py). Rules that must hold:
- after a step that ran, the mirror holds exactly the rids of that batch that ran (refused ones are
  dropped), under that batch's step number; after a failed step it is empty;
- a slice may reuse slots only of the batch numbered `step - 1`: anything else, or a rid it does not
  hold with at least `kv_reuse` slots, is a protocol error (ValueError, nothing written), never a guess.
All ranks receive identical batches and agree on refusals, so their mirrors stay identical.
"""

from __future__ import annotations

import torch

from shared.messages import ReqSlice


class KVSlotMirror:
    def __init__(self) -> None:
        self._slots: dict[str, torch.Tensor] = {}  # rid -> int64 [positions], on the rank's device
        self._step: int | None = None  # the batch the slots are from

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, rid: str) -> torch.Tensor | None:
        return self._slots.get(rid)

    def resolve(self, reqs: list[ReqSlice], step: int, device: torch.device, kv_capacity: int) -> list[torch.Tensor]:
        """The full KV slot list of every slice of batch `step`, in order: the first `kv_reuse` slots
        from the mirror, then the slice's own `kv_slots`. Validates every slice (non-empty, unique
        rid, slot count, new slots in [1, kv_capacity] unless kv_capacity is 0) and raises ValueError
        before anything is built. Changes nothing: `commit` does, once the step ran."""
        held = self._slots if self._step is not None and step == self._step + 1 else {}
        seen: set[str] = set()
        new_all: list[int] = []
        for r in reqs:
            _check_slice(r, seen, held, step, kv_capacity)
            new_all.extend(r.kv_slots)
        flat = torch.tensor(new_all, dtype=torch.int64, device=device)
        out: list[torch.Tensor] = []
        off = 0
        for r in reqs:
            part = flat[off : off + len(r.kv_slots)]
            off += len(r.kv_slots)
            out.append(torch.cat((held[r.rid][: r.kv_reuse], part)) if r.kv_reuse else part)
        return out

    def commit(self, step: int, rids: list[str], kv_full: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        """Batch `step` ran for `rids` (the non-refused slices) with these full slot lists."""
        self._slots = dict(zip(rids, kv_full, strict=True))
        self._step = step

    def clear(self) -> None:
        """A step failed (or its outcome is unknown): reuse nothing until a full list comes again."""
        self._slots = {}
        self._step = None

    def check_integrity(self) -> None:
        assert self._step is not None or not self._slots, "slots held without a step"
        for rid, kv in self._slots.items():
            assert kv.dtype == torch.int64 and kv.dim() == 1, (rid, kv.dtype, kv.shape)


def _check_slice(r: ReqSlice, seen: set[str], held: dict[str, torch.Tensor], step: int, kv_capacity: int) -> None:
    n = len(r.input_ids)
    if n == 0:
        raise ValueError(f"request {r.rid}: empty input_ids")
    if r.rid in seen:
        raise ValueError(f"request {r.rid} appears twice in one batch")
    seen.add(r.rid)
    if r.start_pos < 0 or r.kv_reuse < 0 or r.kv_reuse + len(r.kv_slots) != r.start_pos + n:
        raise ValueError(
            f"request {r.rid}: kv_reuse {r.kv_reuse} + {len(r.kv_slots)} kv_slots for start_pos {r.start_pos}"
            f" + {n} tokens"
        )
    if r.kv_reuse:
        prior = held.get(r.rid)
        have = 0 if prior is None else int(prior.shape[0])
        if have < r.kv_reuse:
            raise ValueError(
                f"request {r.rid}: kv_reuse {r.kv_reuse} but the worker holds {have} of its KV slots from"
                f" step {step - 1}"
            )
    if kv_capacity and r.kv_slots and (min(r.kv_slots) < 1 or max(r.kv_slots) > kv_capacity):
        raise ValueError(f"request {r.rid}: KV slot outside [1, {kv_capacity}]")
