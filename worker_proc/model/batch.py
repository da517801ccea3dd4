"""`StepBatch`: one step's requests flattened into tensors the model consumes.

Built from `ReqSlice`s (see shared/messages.py for their meaning);
all requests' new tokens are concatenated into one token dimension (rows) so projections and MLPs
run once per step. Requests with exactly one new token form the first *decode group* (one batched
state update and attention per layer); a slice verifying drafts either joins the prefill segments or,
when the kernel set is batch invariant, adds one decode group per input position, run in order; the
other slices form the *prefill group* (every mixer hands all of its segments to one `*_prefill_many`
call, which a kernel set may batch). `by_group` is the one dispatch of a step's rows onto the groups
that every mixer uses.
Images (a model with a vision tower): a slice's `images` are checked here (shared/images.py `check_image`,
their placeholder tokens); `image_spans` records which rows are which image's tokens, and the model puts
the tower's encodings there in place of the token embeddings. With multimodal RoPE (`mrope`)
`rope_positions` holds every row's (t, h, w) rotary positions (shared/images.py `rope_positions`: a text
row's is start_pos + rope_delta + i on every axis).
Validation here is what protects the pools from a malformed batch: every slot is range-checked when
it arrives (slots reused through `KVSlotMirror` were checked in the batch that sent them). Per-request
slot lists are tensors end to end: the mirror's prefix and the new slots are concatenated on the device
and the decode index is padded by copies, never through a Python list of every slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch

from shared.images import check_image, rope_positions
from shared.messages import ImageInput, ReqSlice
from shared.model_config import VisionConfig
from worker_proc.model.kv_mirror import KVSlotMirror

MAX_DRAFT_NEXT = 16  # the most guesses one slice asks of the MTP layers (--speculative-num-draft-tokens)

GroupFn = Callable[[torch.Tensor | None], torch.Tensor]
"""A mixer's computation for the prefill segments of a step's rows (see `StepBatch.by_group`)."""


def rows_of(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`t`'s rows of one group (all of `t` for None)."""
    return t if rows is None else t[rows]


class RecurrentMixer(Protocol):
    def recur_decode(self, inputs: tuple[torch.Tensor, ...], rows: torch.Tensor | None, slots: torch.Tensor,
                     conv_pool: torch.Tensor, state_pool: Any, ops: Any) -> torch.Tensor: ...  # fmt: skip


@dataclass(frozen=True)
class KeptInputs:
    """One recurrent layer's kernel inputs of a step (every row), kept so that a verify slice's accepted
    tokens can be run through the layer's recurrence again (worker_proc.spec.verify)."""

    mixer: RecurrentMixer
    inputs: tuple[torch.Tensor, ...]
    conv_pool: torch.Tensor
    state_pool: Any


@dataclass(frozen=True)
class PrefillSeg:
    """One request with more than one new token: rows [row_start, row_end) of the step."""

    row_start: int
    row_end: int
    start_pos: int
    kv_idx: torch.Tensor  # [start_pos + L] int64, KV slot of every position so far
    state_slot: int


@dataclass(frozen=True)
class DecodeGroup:
    """Rows that each advance one request by one token: row i has state slot `state_slots[i]`
    (distinct within the group) and attends over `kv_idx[i, :kv_len[i]]` (padded with slot 0)."""

    rows: torch.Tensor  # [Bt] int64 rows of the step
    state_slots: torch.Tensor  # [Bt] int64
    kv_idx: torch.Tensor  # [Bt, Tmax] int64
    kv_len: torch.Tensor  # [Bt] int64


@dataclass(frozen=True)
class ImageSpan:
    """Rows [row_start, row_end) of the step are tokens [first, first + rows) of the image `digest`."""

    row_start: int
    row_end: int
    digest: str
    first: int


DecodeFn = Callable[[DecodeGroup, torch.Tensor | None], torch.Tensor]
"""A mixer's computation for one decode group (the group, and its rows: None when they are the step's)."""


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of every row
    new_kv_slots: torch.Tensor  # [T] int64, KV slot each row writes
    prefill: tuple[PrefillSeg, ...]
    # run in order: the requests with one new token, then (when verify slices run token by token) one
    # group per input position of the verify slices, each after the one before it
    decode_groups: tuple[DecodeGroup, ...]
    logit_rows: torch.Tensor  # [R] int64 rows whose logits are wanted
    logit_rids: tuple[str, ...]  # request id of each logit row
    kv_full: tuple[torch.Tensor, ...] = ()  # full KV slot list of each request, in slice order
    kept_inputs: list[KeptInputs] | None = None  # filled by the recurrent layers when a slice verifies drafts
    rope_positions: torch.Tensor | None = None  # [3, T] int64 (t, h, w) rotary positions (multimodal RoPE)
    image_spans: tuple[ImageSpan, ...] = ()  # rows that take an image's encoding, in row order
    images: tuple[ImageInput, ...] = ()  # the images of image_spans, one per digest
    # (adapter slot, its runs of rows [start, end)) of every slot > 0 a slice runs under, by slot
    lora_rows: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()
    lora_row_slot: torch.Tensor | None = None  # [T] int64 adapter slot of every row (0: the base), with lora_rows

    @property
    def rope_input(self) -> torch.Tensor:
        """The positions the rotary tables are made from: `rope_positions` where the model has them."""
        return self.positions if self.rope_positions is None else self.rope_positions

    def keep_recurrent_inputs(self, mixer: RecurrentMixer, inputs: tuple[torch.Tensor, ...],
                              conv_pool: torch.Tensor, state_pool: Any) -> None:  # fmt: skip
        """A recurrent layer hands over its kernel inputs; kept only in a step that verifies drafts."""
        if self.kept_inputs is not None:
            self.kept_inputs.append(KeptInputs(mixer, inputs, conv_pool, state_pool))

    @cached_property
    def prefill_spans(self) -> tuple[tuple[int, int], ...]:
        """(length, state slot) of each prefill segment, in row order (worker_proc.kernels.segments)."""
        return tuple((seg.row_end - seg.row_start, seg.state_slot) for seg in self.prefill)

    @cached_property
    def prefill_rows(self) -> torch.Tensor | None:
        """The prefill segments' rows, concatenated in order; None when they are every row of the step."""
        if not self.decode_groups:
            return None
        rows = [torch.arange(seg.row_start, seg.row_end) for seg in self.prefill]
        return torch.cat(rows).to(self.input_ids.device)

    @cached_property
    def prefill_attn_spans(self) -> tuple[tuple[int, int, torch.Tensor], ...]:
        """(length, start_pos, kv_idx) of each prefill segment, in row order (attention's spans)."""
        return tuple((seg.row_end - seg.row_start, seg.start_pos, seg.kv_idx) for seg in self.prefill)

    def by_group(self, decode: DecodeFn, prefill: GroupFn) -> torch.Tensor:
        """A mixer's output over the step: `decode(group, rows)` computes one decode group's rows (the
        groups in order) and `prefill(rows)` every prefill segment's at once (rows: that group's rows
        of the step, in order; None when the group is the whole step and its inputs are taken whole).
        A step with several groups writes each group's rows of one output."""
        groups = self.decode_groups
        if not groups:
            return prefill(None)
        if len(groups) == 1 and not self.prefill:
            return decode(groups[0], None)
        parts = [(g.rows, decode(g, g.rows)) for g in groups]
        if self.prefill:
            parts.append((self.prefill_rows, prefill(self.prefill_rows)))
        first = parts[0][1]
        out = first.new_empty((self.input_ids.shape[0], *first.shape[1:]))
        for rows, y in parts:
            out[rows] = y
        return out


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
    verify_by_token: bool = False,
    vision: VisionConfig | None = None,
    mrope: bool = False,
    lora_slots: frozenset[int] = frozenset(),
) -> StepBatch:
    """Flatten and validate `reqs` (batch number `step`). Raises ValueError on a malformed slice (slot
    out of range, wrong kv_slots length, duplicate rid or state slot, a kv_reuse the mirror cannot
    serve); nothing is written either way (the caller commits `kv_full` to the mirror after the step
    ran). Without `mirror` every slice must carry its full slot list (kv_reuse == 0). `all_rows`: want
    logits for every row of every request (tests), instead of the last row of each slice with sample;
    a slice with prompt_logprobs >= 0 or drafts gets every row too. `verify_by_token`: a verify slice
    runs as one decode group per input position instead of as a prefill segment (the kernel choice's).
    `vision`: the model's tower (None or depth 0: a slice with images is a ValueError); `mrope`: make
    `rope_positions`; `lora_slots`: the adapter slots that hold an adapter (a slice under another slot but 0
    is a ValueError)."""
    _check_slices(reqs, state_capacity, has_recurrent_state)
    bad = next((r for r in reqs if r.lora_slot and r.lora_slot not in lora_slots), None)
    if bad is not None:
        raise ValueError(f"{bad.rid}: adapter slot {bad.lora_slot} holds no adapter")
    vision = vision or VisionConfig()
    for r in reqs:
        if r.images:
            _check_images(r, vision)
    source = mirror if mirror is not None else KVSlotMirror()
    kv_full = source.resolve(reqs, step, device, kv_capacity if uses_attention else 0)
    ids: list[int] = []
    positions: list[int] = []
    segs: list[PrefillSeg] = []
    by_token: list[list[tuple[int, int, torch.Tensor, int]]] = [[]]  # per group: (row, slot, kv, kv_len)
    logit_rows: list[int] = []
    logit_rids: list[str] = []
    axes: tuple[list[int], list[int], list[int]] = ([], [], [])
    spans: list[ImageSpan] = []
    images: dict[str, ImageInput] = {}
    lora: dict[int, list[tuple[int, int]]] = {}
    row_slot: list[int] = []
    for r, kv in zip(reqs, kv_full, strict=True):
        n = len(r.input_ids)
        row = len(ids)
        row_slot.extend([r.lora_slot] * n)
        if r.lora_slot:
            runs = lora.setdefault(r.lora_slot, [])
            if runs and runs[-1][1] == row:
                runs[-1] = (runs[-1][0], row + n)
            else:
                runs.append((row, row + n))
        ids.extend(r.input_ids)
        positions.extend(range(r.start_pos, r.start_pos + n))
        if mrope:
            _add_rope_positions(axes, r, vision.spatial_merge_size)
        for img in sorted(r.images, key=lambda i: i.offset):
            a, b = max(img.offset, r.start_pos), min(img.end, r.start_pos + n)
            spans.append(ImageSpan(row + a - r.start_pos, row + b - r.start_pos, img.digest, a - img.offset))
            images.setdefault(img.digest, img)
        if n == 1:
            by_token[0].append((row, r.state_slot, kv, int(kv.shape[0])))
        elif r.drafts and verify_by_token:
            by_token.extend([] for _ in range(n + 1 - len(by_token)))
            for i in range(n):
                by_token[i + 1].append((row + i, r.state_slot, kv, r.start_pos + i + 1))
        else:
            segs.append(PrefillSeg(row, row + n, r.start_pos, kv, r.state_slot))
        if all_rows or r.prompt_logprobs >= 0 or r.drafts:  # every row: tests, prompt logprobs, drafts
            logit_rows.extend(range(row, row + n))
            logit_rids.extend([r.rid] * n)
        elif r.sample:
            logit_rows.append(row + n - 1)
            logit_rids.append(r.rid)

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    groups = tuple(
        DecodeGroup(t([m[0] for m in g]), t([m[1] for m in g]), _pad_rows([m[2] for m in g], device),
                    t([m[3] for m in g]))  # fmt: skip
        for g in by_token if g
    )
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return StepBatch(
        input_ids=t(ids),
        positions=t(positions),
        new_kv_slots=torch.cat([kv[r.start_pos :] for r, kv in zip(reqs, kv_full, strict=True)]) if reqs else empty,
        prefill=tuple(segs),
        decode_groups=groups,
        logit_rows=t(logit_rows),
        logit_rids=tuple(logit_rids),
        kv_full=tuple(kv_full),
        kept_inputs=[] if any(r.drafts for r in reqs) else None,
        rope_positions=torch.tensor(axes, dtype=torch.int64, device=device) if mrope else None,
        image_spans=tuple(spans),
        images=tuple(images.values()),
        lora_rows=tuple((slot, tuple(runs)) for slot, runs in sorted(lora.items())),
        lora_row_slot=t(row_slot) if lora else None,
    )


def _add_rope_positions(axes: tuple[list[int], list[int], list[int]], r: ReqSlice, merge: int) -> None:
    """The slice's rows' (t, h, w) rotary positions appended to `axes`."""
    n = len(r.input_ids)
    if not r.images:
        text = range(r.start_pos + r.rope_delta, r.start_pos + r.rope_delta + n)
        for ax in axes:
            ax.extend(text)
        return
    for ax, got in zip(axes, rope_positions(r.start_pos, n, r.images, r.rope_delta, merge), strict=True):
        ax.extend(got)


def _check_images(r: ReqSlice, vision: VisionConfig) -> None:
    """A slice's images: a tower to encode them, well-formed, inside the slice, apart, and over placeholders."""
    if not vision.depth:
        raise ValueError(f"{r.rid}: a slice with {len(r.images)} images, but the model has no vision tower")
    end, last = r.start_pos + len(r.input_ids), -1
    for img in sorted(r.images, key=lambda i: i.offset):
        problem = check_image(img, vision.spatial_merge_size, vision.patch_dim)
        if problem:
            raise ValueError(f"{r.rid}: {problem}")
        if img.end <= r.start_pos or img.offset >= end:
            raise ValueError(f"{r.rid}: image at prompt positions [{img.offset}, {img.end}) is outside the slice's "
                             f"[{r.start_pos}, {end})")
        if img.offset < last:
            raise ValueError(f"{r.rid}: images overlap at prompt position {img.offset}")
        last = img.end
        if img.token_id != vision.image_token_id:
            raise ValueError(f"{r.rid}: image token id {img.token_id}, the model's is {vision.image_token_id}")
        a, b = max(img.offset, r.start_pos) - r.start_pos, min(img.end, end) - r.start_pos
        if any(t != img.token_id for t in r.input_ids[a:b]):
            raise ValueError(f"{r.rid}: the input ids at image positions [{img.offset}, {img.end}) are not all its "
                             f"placeholder {img.token_id}")


def _check_slices(reqs: list[ReqSlice], state_capacity: int, has_recurrent_state: bool) -> None:
    for r in reqs:
        if r.drafts and not (0 < r.drafts < len(r.input_ids) and r.sample):
            raise ValueError(f"{r.rid}: {r.drafts} drafts in a slice of {len(r.input_ids)} tokens")
        if r.draft_next and not (0 < r.draft_next <= MAX_DRAFT_NEXT and r.sample):
            raise ValueError(f"{r.rid}: draft_next {r.draft_next} (1..{MAX_DRAFT_NEXT}, sampling slices only)")
    if has_recurrent_state:
        _check_state_slots([r.state_slot for r in reqs] + [r.backup_slot for r in reqs if r.drafts], state_capacity)


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
