"""Verifying drafted tokens (ReqSlice.drafts > 0): which drafts a verify slice accepts, and leaving its
recurrent state after exactly the accepted tokens.

Acceptance (rank 0): the slice is sampled after every input position by the request's own rules, the
draw at position i being the draw of output index `output_len + i` with the drafts before it in the
history. Such a draw is the one the request would make without drafts, so accepting a draft while the
draw equals it and emitting the first draw that differs keeps the target distribution exactly (the
drafts are deterministic guesses: this is rejection sampling with a one-hot proposal); greedy, it is
the longest prefix of drafts the argmax agrees with. A drawn stop token ends the run: it is the token
emitted after the accepted drafts, never an accepted draft.

State (every rank, told the counts by rank 0): before the forward the slice's state is copied into
its backup slot, and the forward advances the state over every input. When a draft was rejected the
backup is copied back and the accepted tokens (the last token and the accepted drafts) run again
through each recurrent layer's recurrence from the step's kept kernel inputs (no projection runs
again). Attention needs nothing: the KV of a rejected position sits in a slot the scheduler frees.
"""

from __future__ import annotations

import torch

from shared.messages import ReqSlice
from worker_proc.kernels import KernelOps
from worker_proc.model.batch import StepBatch
from worker_proc.output.logit_processing import SampleRequest
from worker_proc.output.sampling import greedy_params
from worker_proc.state.pools import StatePools


def position_requests(r: ReqSlice) -> list[SampleRequest]:
    """One draw per input position of verify slice `r`, in order."""
    params = r.sampling or greedy_params()
    guesses = r.input_ids[len(r.input_ids) - r.drafts :]
    out = []
    for i in range(r.drafts + 1):
        history = None if r.history is None else r.history + guesses[:i]
        out.append(SampleRequest(r.rid, params, r.output_len + i, history))
    return out


def accepted_drafts(r: ReqSlice, draws: list[int], eos_ids: tuple[int, ...]) -> int:
    """How many of `r`'s drafts the draws after each of its positions accept."""
    params = r.sampling or greedy_params()
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    guesses = r.input_ids[len(r.input_ids) - r.drafts :]
    n = 0
    while n < r.drafts and draws[n] == guesses[n] and draws[n] not in stops:
        n += 1
    return n


def emitted_rows(sreqs: list[SampleRequest], starts: dict[int, int], accepted: dict[str, int]) -> list[int]:
    """The indices of a step's draws that became output tokens, in order: every plain draw, and of a
    verify slice (its first draw's index in `starts` -> its draft count) its accepted drafts and the
    draw after them."""
    rows: list[int] = []
    i = 0
    while i < len(sreqs):
        n = starts[i] + 1 if i in starts else 1
        keep = accepted[sreqs[i].rid] + 1 if i in starts else 1
        rows.extend(range(i, i + keep))
        i += n
    return rows


def emitted(sreqs: list[SampleRequest], tokens: list[int], starts: dict[int, int], accepted: dict[str, int]
            ) -> tuple[list[SampleRequest], list[int]]:  # fmt: skip
    """`emitted_rows`' draws and their tokens."""
    rows = emitted_rows(sreqs, starts, accepted)
    return [sreqs[i] for i in rows], [tokens[i] for i in rows]


def back_up(pools: StatePools, reqs: list[ReqSlice]) -> None:
    """Copy each verify slice's state into its backup slot (before the forward)."""
    for r in reqs:
        if r.drafts and pools.states:
            pools.copy_state(r.state_slot, r.backup_slot)


def roll_back(pools: StatePools, sb: StepBatch, reqs: list[ReqSlice], accepted: list[int],
              ops: KernelOps) -> None:  # fmt: skip
    """Leave every verify slice's state after its accepted tokens (`accepted`: the count of each verify
    slice of `reqs`, in order): the backup is restored and the accepted tokens advance it one decode
    step at a time, the k-th tokens of every rolled-back slice in one step."""
    steps: list[list[tuple[int, int]]] = []  # per step: (row, state slot)
    at, v = 0, 0
    for r in reqs:
        if r.drafts:
            if accepted[v] < r.drafts and pools.states:
                pools.copy_state(r.backup_slot, r.state_slot)
                keep = accepted[v] + 1
                steps.extend([] for _ in range(keep - len(steps)))
                for i in range(keep):
                    steps[i].append((at + i, r.state_slot))
            v += 1
        at += len(r.input_ids)
    device = sb.input_ids.device
    for step in steps:
        rows = torch.tensor([row for row, _ in step], dtype=torch.int64, device=device)
        slots = torch.tensor([slot for _, slot in step], dtype=torch.int64, device=device)
        for kept in sb.kept_inputs or ():
            kept.mixer.recur_decode(kept.inputs, rows, slots, kept.conv_pool, kept.state_pool, ops)
