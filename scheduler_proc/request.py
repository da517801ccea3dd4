"""Scheduler-side request state and the waiting queue.

A `Req` is owned by the Scheduler's request table from `add_request` until its final TokenOut. `sent_kv` /
`sent_step` record what the workers mirror of its kv_slots: every change to kv_slots[:sent_kv] other
than appending calls `forget_sent` (resources.py). While
WAITING it holds no slot and no lock (retraction and rollbacks give everything back first); while
RUNNING it owns kv_slots[tree_len:], its state_slot, one KV lock on `node` (whose path supplies
kv_slots[:tree_len]), until the batch that copies it is applied, one state lock on `cow_node`, and
while a verify step of its drafts is in flight, the state slot lent for it (`backup_slot`); while
LOADING (a stored prefix is loading for it) it holds only its `load` ticket, which owns one KV lock on
the ticket's node and the slots the load fills.
A prompt's images (shared/images.py): `tokens` holds each image's key token at its positions, so that the
radix tree and the state store match an image by its content; the workers get the placeholder token
there (`model_ids`) with the image itself (`images_in`) and the rotary offset (`rope_delta`).
A request under a LoRA adapter (`lora`, lora_slots.py): `tokens[0]` is the key token of (the adapter's uid,
the first key token), so that each adapter's prefixes live in their own subtree of the radix tree and their
own block keys in the state store; `model_ids` gives the workers the real first token (`first_id`).
"""

from __future__ import annotations

import heapq
import itertools
import time
from enum import Enum
from typing import TYPE_CHECKING

from scheduler_proc.lora_slots import AdapterUse, namespace_token
from shared.images import key_tokens, rope_delta
from shared.messages import FinishReason, GenerateReq, ImageInput, SamplingParams, TokenOut

if TYPE_CHECKING:
    from scheduler_proc.radix_cache import PeekResult
    from scheduler_proc.radix_node import TreeNode
    from scheduler_proc.store_tier import BlockKeys, LoadTicket


class ReqStatus(Enum):
    WAITING = "waiting"
    LOADING = "loading"  # out of the queue while a stored prefix loads (ReqResources.start_load)
    RUNNING = "running"
    FINISHED = "finished"


class Req:
    __slots__ = (
        "rid", "prompt_len", "tokens", "sampling", "priority", "seq", "status",
        "kv_slots", "tree_len", "node", "state_slot", "computed", "cow_node", "splits",
        "pending_ckpt", "cached_tokens", "admitted", "abort_reason", "peek", "queue_token",
        "retracted_at", "refusals", "sent_kv", "sent_step", "prompt_lps", "prompt_tops", "prompt_ranks",
        "save_prompt_state", "backup_slot", "arrived", "queue_s", "store_keys", "store_checked", "load",
        "loaded_tokens", "images", "lora", "first_id",
    )  # fmt: skip

    def __init__(self, rid: str, input_ids: list[int], sampling: SamplingParams, priority: int, seq: int,
                 images: tuple[ImageInput, ...] = (), lora: AdapterUse | None = None) -> None:  # fmt: skip
        self.rid = rid
        self.prompt_len = len(input_ids)
        self.images = images  # by offset, each inside the prompt
        # prompt + generated tokens, an image's positions holding its key token
        self.tokens: list[int] = key_tokens(input_ids, images) if images else list(input_ids)
        self.lora = lora  # the adapter it runs under (None: the base model), counted in its AdapterUse
        self.first_id = input_ids[0] if input_ids else 0  # the token the model reads at position 0
        if lora is not None and self.tokens:
            self.tokens[0] = namespace_token(lora.adapter.uid, self.tokens[0])
        self.sampling = sampling
        self.priority = priority
        self.seq = seq  # arrival order; the queue key, kept across requeues so a request keeps its place
        self.status = ReqStatus.WAITING
        self.kv_slots: list[int] = []  # KV slot of every position with KV (computed or being computed)
        self.tree_len = 0  # kv_slots[:tree_len] belong to the radix tree
        self.node: TreeNode | None = None  # KV-locked prefix node (tree_len == node.end)
        self.state_slot: int | None = None
        self.computed = 0  # positions whose KV and state are written (applied steps only)
        self.cow_node: TreeNode | None = None  # state-locked CoW source until the copy has run
        self.splits: list[int] = []  # ascending positions where a checkpoint is wanted
        self.pending_ckpt = False  # computed reached a split point: save the state next round
        self.cached_tokens = 0  # prefix served from the cache at the first admission
        self.admitted = False  # has been admitted (and not refused) at least once
        self.abort_reason: str | None = None  # abort requested while the request was in flight
        self.peek: PeekResult | None = None  # last peek; reusable while the cache epoch is unchanged
        self.queue_token = 0
        self.retracted_at = -1  # `computed` when last retracted (to count recomputation), -1 if never
        self.refusals = 0  # admissions refused for memory so far (later attempts count as retries)
        # the workers' copy of kv_slots (ReqSlice.kv_reuse): its first sent_kv slots as sent in batch
        # sent_step, which ran for this request; valid only while kv_slots[:sent_kv] is unchanged
        self.sent_kv = 0
        self.sent_step = -1
        # with sampling.prompt_logprobs: entry k is of prompt token k + 1 (filled as prefill slices run)
        self.prompt_lps: list[float] = []
        self.prompt_tops: list[list[tuple[int, float]]] = []
        self.prompt_ranks: list[int] = []
        self.save_prompt_state = False  # GenerateReq.save_prompt_state: a split point at prompt_len - 1
        self.backup_slot: int | None = None  # state slot lent for the in-flight verify step (drafting.py)
        self.arrived = time.monotonic()  # when the scheduler received it
        self.queue_s = -1.0  # seconds from arrival to its first admission into a batch (-1: not yet)
        self.store_keys: BlockKeys | None = None  # its block keys in the state store, as far as computed
        self.store_checked = False  # the state store was asked for its prefix since it last started waiting
        self.load: LoadTicket | None = None  # while LOADING: the load it waits for (owns its slots)
        self.loaded_tokens = 0  # prompt tokens the state store served it (before its first admission)

    def mark_sent(self, step: int, n_slots: int) -> None:
        """Batch `step` ran this request with kv_slots[:n_slots]: the workers hold those slots."""
        self.sent_step, self.sent_kv = step, n_slots

    def forget_sent(self) -> None:
        """kv_slots[:sent_kv] changed (or may have): the next slice carries the full list."""
        self.sent_step, self.sent_kv = -1, 0

    def kv_reuse(self, step: int) -> int:
        """Leading slots the workers can take from their copy for batch `step` (0: send them all)."""
        return self.sent_kv if self.sent_step == step - 1 else 0

    def model_ids(self, a: int, b: int) -> list[int]:
        """The tokens the model reads at positions [a, b): `tokens` with each image's placeholder token."""
        ids = self.tokens[a:b]
        if a == 0 < b and self.lora is not None:
            ids[0] = self.first_id
        for img in self.images_in(a, b):
            lo, hi = max(img.offset, a), min(img.end, b)
            ids[lo - a : hi - a] = [img.token_id] * (hi - lo)
        return ids

    def images_in(self, a: int, b: int) -> list[ImageInput]:
        """The images with tokens among positions [a, b)."""
        return [img for img in self.images if img.offset < b and img.end > a]

    @property
    def lora_slot(self) -> int:
        """The adapter slot its slices run under (0: the base model)."""
        return self.lora.slot if self.lora is not None else 0

    def rope_delta(self, pos: int) -> int:
        return rope_delta(self.images, pos) if self.images else 0

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the one decode token left to compute (a prompt, or tokens lost to a retraction)."""
        return len(self.tokens) - self.computed > 1

    def __repr__(self) -> str:
        return f"Req({self.rid!r}, {self.status.value}, computed={self.computed}/{len(self.tokens)})"


class WaitingQueue:
    """Waiting requests ordered by (-priority if by priority, arrival seq).

    A heap with lazy removal: `remove` and `pop` invalidate the request's entry via its queue token,
    so peek/pop are O(log n) amortised and a requeued request returns to its original place.
    """

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._heap: list[tuple[int, int, int, Req]] = []
        self._live = 0
        self._tokens = itertools.count(1)

    def __len__(self) -> int:
        return self._live

    def push(self, req: Req) -> None:
        if req.queue_token:
            raise AssertionError(f"{req} is already queued")
        req.queue_token = next(self._tokens)
        key = -req.priority if self.by_priority else 0
        heapq.heappush(self._heap, (key, req.seq, req.queue_token, req))
        self._live += 1

    def peek(self) -> Req | None:
        heap = self._heap
        while heap:
            _, _, token, req = heap[0]
            if token == req.queue_token:
                return req
            heapq.heappop(heap)
        return None

    def pop(self) -> Req:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty waiting queue")
        heapq.heappop(self._heap)
        req.queue_token = 0
        self._live -= 1
        return req

    def remove(self, req: Req) -> None:
        if not req.queue_token:
            raise AssertionError(f"{req} is not queued")
        req.queue_token = 0
        self._live -= 1
        if len(self._heap) > 2 * self._live + 1024:
            self._heap = [e for e in self._heap if e[2] == e[3].queue_token]
            heapq.heapify(self._heap)

    def __contains__(self, req: Req) -> bool:
        return bool(req.queue_token)

    def items(self) -> list[Req]:
        """Live requests in queue order (O(n log n); for tests, info and fail_all)."""
        return [e[3] for e in sorted(self._heap, key=lambda e: e[:3]) if e[2] == e[3].queue_token]


def validate(req: GenerateReq, duplicate: bool, context_length: int, kv_capacity: int, states: int | None) -> str:
    """Why `req` can never run ("" if it can): `states` is the Mamba pool size (None: no Mamba layers)."""
    n_prompt, n_new = len(req.input_ids), req.sampling.max_new_tokens
    if duplicate:
        return f"duplicate request id {req.rid!r}"
    if n_prompt == 0:
        return "empty prompt"
    if n_new < 0:
        return f"max_new_tokens must be >= 0, got {n_new}"
    if n_prompt + n_new > context_length:
        return f"prompt ({n_prompt}) + max_new_tokens ({n_new}) exceeds the context length {context_length}"
    if n_prompt + n_new - 1 > kv_capacity:
        return (f"prompt ({n_prompt}) + max_new_tokens ({n_new}) can never fit the KV cache: it needs "
                f"{n_prompt + n_new - 1} token slots, the pool has {kv_capacity} (--max-total-tokens)")
    if states is not None and states < 1:
        return "the Mamba state pool has no slot"
    return _images_error(req)


def _images_error(req: GenerateReq) -> str:
    """Why the request's images do not fit its prompt ("" if they do): each inside it, in order, apart."""
    end = 0
    for img in req.images:
        if img.length < 1 or img.offset < end or img.end > len(req.input_ids):
            return f"image at prompt positions [{img.offset}, {img.end}) overlaps another or leaves the prompt"
        if any(t != img.token_id for t in req.input_ids[img.offset : img.end]):
            return f"prompt positions [{img.offset}, {img.end}) do not all hold the image token {img.token_id}"
        end = img.end
    return ""


def token_out(r: Req, new: list[int], reason: FinishReason | None, matched: int | None = None,
              logprobs: list[float] | None = None, error: str | None = None,
              top: list[list[tuple[int, float]]] | None = None, rejected: bool = False) -> TokenOut:  # fmt: skip
    """The reply for `r` carrying `new` tokens; final when `reason` is set. The first reply with a
    token carries the request's queue time and the prompt logprobs it asked for."""
    first_tokens = bool(new) and r.num_output == len(new)
    first = first_tokens and r.sampling.prompt_logprobs >= 0
    return TokenOut(
        rid=r.rid, token_ids=new, finished=reason is not None, finish_reason=reason, matched_stop_token=matched,
        prompt_tokens=r.prompt_len, cached_tokens=r.cached_tokens, completion_tokens=r.num_output,
        logprobs=logprobs, error=error, rejected=rejected, top_logprobs=top,
        prompt_logprobs=list(r.prompt_lps) if first else None,
        prompt_top_logprobs=list(r.prompt_tops) if first and r.sampling.prompt_logprobs > 0 else None,
        prompt_ranks=list(r.prompt_ranks) if first else None, queue_s=r.queue_s if first_tokens else -1.0,
    )  # fmt: skip
