"""ReqResources: acquires and gives back one request's slots and locks.

Owns the KV and state slot allocators and the HybridRadixCache: the Scheduler reaches the cache only
through here (reads aside). Every path that takes something from a request (finish, abort,
retraction, refusal, failure) goes through here, so the ownership rules of request.py hold after
each call. No tensors: state copies are only *described* (CopyOp) for the worker.
"""

from __future__ import annotations

import logging

from scheduler_proc.allocators import KVAllocator, StateSlotAllocator
from scheduler_proc.batch import BatchBuilder, SliceEntry
from scheduler_proc.radix_cache import CowMatch, HybridRadixCache, PeekResult
from scheduler_proc.radix_node import TreeNode
from scheduler_proc.request import Req
from scheduler_proc.store_tier import BlockKeys, LoadTicket, StoredPrefix, StoreTier
from shared.messages import CopyOp, StoreLoad

logger = logging.getLogger(__name__)

NO_SPLIT = 1 << 62


def clamp_max_running(wanted: int, state_capacity: int, track_states: bool) -> int:
    """Each running request holds a state slot: at most the pool, less an eighth of it (pools of 8
    and more) kept for copy-on-write copies, checkpoints and cached states. Clamped with a warning
    instead of refusing to start."""
    if not track_states:
        return wanted
    limit = max(1, state_capacity - state_capacity // 8)
    if wanted > limit:
        logger.warning(
            "--max-running-requests %d clamped to %d: the Mamba state pool has %d slots and keeps %d for "
            "copy-on-write, checkpoints and cached states", wanted, limit, state_capacity, state_capacity - limit,
        )  # fmt: skip
        return limit
    return wanted


class ReqResources:
    def __init__(
        self, kv_capacity: int, state_capacity: int, track_states: bool, cache_enabled: bool, ckpt_interval: int,
        prompt_checkpoint: bool = True, store: StoreTier | None = None,
    ) -> None:
        self.kv_alloc = KVAllocator(kv_capacity)
        self.state_alloc = StateSlotAllocator(state_capacity if track_states else 0)
        self.cache = HybridRadixCache(self.kv_alloc, self.state_alloc, track_states)
        self.track_states = track_states
        self.cache_enabled = cache_enabled
        self.ckpt_interval = ckpt_interval if (track_states and cache_enabled) else 0
        self.prompt_checkpoint = prompt_checkpoint
        self.store = store if cache_enabled else None
        if self.store is not None and self.store.write_back:
            self.cache.on_evict = self._write_back

    # ------------------------------------------------------------------ capacity
    def available_kv(self) -> int:
        return self.kv_alloc.num_free + self.cache.kv_evictable

    def available_states(self) -> int:
        return self.state_alloc.num_free + self.cache.states_evictable

    # ------------------------------------------------------------------ admission
    def peek(self, req: Req) -> PeekResult:
        """The request's match, re-walked only when the cache changed since the last one (O(1) retry)."""
        cache = self.cache
        if req.peek is not None and req.peek.epoch == cache.epoch:
            return req.peek
        if self.uses_cache(req):
            req.peek = cache.peek(req.tokens, len(req.tokens) - 1)
        else:
            req.peek = PeekResult(cache.root, 0, 0, 0, 0, cache.epoch)
        return req.peek

    def uses_cache(self, req: Req) -> bool:
        """Whether `req` may start from a cached prefix: not when it wants the logprob of every
        prompt token (those positions must be computed)."""
        return self.cache_enabled and req.sampling.prompt_logprobs < 0

    def fresh_peek(self, req: Req) -> PeekResult:
        """Admission ignoring any cached state (used only when nothing runs and the hit itself cannot
        be afforded: e.g. one state slot in all, held by the matched node)."""
        return PeekResult(self.cache.root, 0, 0, 0, 0, self.cache.epoch)

    def plan_splits(self, req: Req, peek: PeekResult) -> list[int]:
        """Positions where the state is saved: the branch point (KV matched past the deepest state),
        every `ckpt_interval` tokens and, for a request with save_prompt_state, prompt_len - 1, strictly
        inside the tokens to compute (the prefill is cut there); and, unless --disable-prompt-checkpoint,
        the end of the prompt (no cut: the prefill ends there), so that a later request extending this
        prompt, or repeating it, resumes from its state instead of recomputing it all. `first_split`
        ignores the prompt end: it caps no chunk."""
        if not (self.cache_enabled and self.track_states):
            return []
        start, end = peek.prefix_len, len(req.tokens)
        points = set()
        if start < peek.kv_len < end:
            points.add(peek.kv_len)
        if req.save_prompt_state and start < req.prompt_len - 1 < end:
            points.add(req.prompt_len - 1)
        if self.ckpt_interval:
            first = (start // self.ckpt_interval + 1) * self.ckpt_interval
            points.update(range(first, end, self.ckpt_interval))
        if (stored := self._store_split(req)) is not None and start < stored < end:
            points.add(stored)
        if self.prompt_checkpoint:
            points.add(end)
        return sorted(points)

    def _store_split(self, req: Req) -> int | None:
        """With a state store: the last block end before the prompt's last token, where the state a
        later request loads is taken (None without a store, or when the prompt has no full block)."""
        if self.store is None:
            return None
        b = self.store.block
        return (req.prompt_len - 1) // b * b or None

    def first_split(self, req: Req, peek: PeekResult) -> int | None:
        """The first planned split inside the prompt (None when there is none) in O(1): admission asks every round,
        and a long prompt with periodic checkpoints has prompt/interval split points."""
        if not (self.cache_enabled and self.track_states):
            return None
        start, end = peek.prefix_len, len(req.tokens)
        first = peek.kv_len if start < peek.kv_len < end else None
        last = req.prompt_len - 1
        if req.save_prompt_state and start < last < end and (first is None or last < first):
            first = last
        if self.ckpt_interval:
            periodic = (start // self.ckpt_interval + 1) * self.ckpt_interval
            if periodic < end and (first is None or periodic < first):
                first = periodic
        stored = self._store_split(req)
        if stored is not None and start < stored < end and (first is None or stored < first):
            first = stored
        return first

    def start(self, req: Req, peek: PeekResult, chunk: int, b: BatchBuilder) -> str:
        """Lock the match, take the request's state slot (CoW or fresh) and KV for the first chunk.
        Returns "" on success or the refusal reason ("mamba_state", "kv") with everything undone;
        StateCowAllocError propagates from the cache (which has undone its locks)."""
        assert peek.epoch == self.cache.epoch, "stale peek at admission"
        if self.uses_cache(req):
            match = self.cache.match_and_cow(req.tokens, len(req.tokens) - 1, peek)
        else:
            match = CowMatch(self.cache.root, 0, [], None, None)
        slot = match.dst_state
        if self.track_states and slot is None:
            slot = self.cache.alloc_state()
            if slot is None:
                self.cache.unlock(match.node)
                return "mamba_state"
        kv = self.cache.alloc_kv(chunk)
        if kv is None:
            if slot is not None:
                self.state_alloc.free(slot)
            if match.src_state is not None:
                self.cache.unlock_state(match.node)
            self.cache.unlock(match.node)
            return "kv"
        req.node, req.tree_len, req.computed = match.node, match.prefix_len, match.prefix_len
        req.kv_slots = match.prefix_kv + kv
        req.forget_sent()
        req.state_slot = slot
        req.splits = self.plan_splits(req, peek)
        if match.src_state is not None:
            assert slot is not None
            req.cow_node = match.node
            b.cow_copies.append(CopyOp(match.src_state, slot, req.rid))
        elif slot is not None:
            b.clears.append(slot)
        return ""

    def next_split_cap(self, req: Req) -> int:
        """Most tokens the next slice may compute without passing a split point."""
        return req.splits[0] - req.computed if req.splits else NO_SPLIT

    # ------------------------------------------------------------------ running
    def grow(self, req: Req, n: int) -> bool:
        kv = self.cache.alloc_kv(n)
        if kv is None:
            return False
        req.kv_slots.extend(kv)
        return True

    def after_step(self, req: Req, entry: SliceEntry, step: int) -> None:
        """The slice of batch `step` ran: its positions are computed (and their slots, which are all of
        kv_slots when it was built, are mirrored by the workers), a pending copy-on-write has happened."""
        req.computed = entry.start + entry.n
        req.mark_sent(step, req.computed)
        if req.cow_node is not None:
            self.cache.unlock_state(req.cow_node)
            req.cow_node = None
        while req.splits and req.splits[0] <= req.computed:
            req.pending_ckpt = req.splits.pop(0) == req.computed

    def undo_slice(self, req: Req, entry: SliceEntry) -> None:
        """The slice did not run (refused): give back the KV slots taken for it (and a lent backup)."""
        extra = req.kv_slots[entry.start :]
        del req.kv_slots[entry.start :]
        req.forget_sent()  # the workers dropped their copy of a refused request
        self.kv_alloc.free_many(extra)
        self._return_backup(req)

    # ------------------------------------------------------------------ drafts
    def lend_for_drafts(self, req: Req, n: int) -> bool:
        """KV slots for `n` drafted positions and a backup state slot for the verify step: free slots,
        else the cache's least recently used unlocked ones (as any allocation; never a running
        request's). False, with nothing taken, when there are not enough."""
        slot = None
        if self.track_states:
            slot = self.cache.alloc_state()
            if slot is None:
                return False
        kv = self.cache.alloc_kv(n)
        if kv is None:
            if slot is not None:
                self.state_alloc.free(slot)
            return False
        req.kv_slots.extend(kv)
        req.backup_slot = slot
        return True

    def settle_drafts(self, req: Req, entry: SliceEntry, accepted: int) -> None:
        """The verify step ran with `accepted` of its drafts accepted: the slots of the rejected
        positions and the backup go back, and the entry computed the decode token and the accepted drafts."""
        keep = entry.start + 1 + accepted
        self.kv_alloc.free_many(req.kv_slots[keep:])
        del req.kv_slots[keep:]
        entry.n = 1 + accepted
        self._return_backup(req)

    def _return_backup(self, req: Req) -> None:
        if req.backup_slot is not None:
            self.state_alloc.free(req.backup_slot)
            req.backup_slot = None

    def checkpoint(self, req: Req, b: BatchBuilder) -> str:
        """Save the request's state at `computed` into the tree through a copy into a fresh slot (the
        copy runs before this round's forward, so it captures the state at the split point); the
        request's prefix then comes from the tree. Returns "saved", "skipped" (no slot) or "exists"."""
        req.pending_ckpt = False
        assert req.state_slot is not None and req.node is not None
        self.store_prefix(req, req.state_slot)
        slot = self.cache.alloc_state()
        if slot is None:
            return "skipped"
        n = req.computed
        node = self.cache.insert(req.tokens, n, req.kv_slots, req.tree_len, slot)
        taken = node.state == slot
        self._move_prefix(req, node)
        if taken:
            b.ckpt_copies.append(CopyOp(req.state_slot, slot, None))
            b.ckpt_nodes.append((node, slot))
        return "saved" if taken else "exists"

    def store_prefix(self, req: Req, state_slot: int | None) -> None:
        """Write-through: queue the store writes of the request's computed prefix (its blocks, and the
        state in `state_slot` when `computed` is a block's end); read before this round's batch runs."""
        if self.store is None or self.store.write_back:
            return
        if req.store_keys is None:
            req.store_keys = BlockKeys()
        self.store.write(req.store_keys, req.tokens, req.kv_slots, req.computed, state_slot)

    def _write_back(self, node: TreeNode) -> None:
        """Write-back: the node leaves the memory cache; store its blocks and, at a block's end, its
        state (the slots still hold them when this round's batch arrives at the workers)."""
        assert self.store is not None
        if self.track_states and node.state is None:
            return
        cache = self.cache
        self.store.write(BlockKeys(), cache.path_tokens(node), cache.path_kv(node), node.end, node.state)

    def write_back_everything(self) -> None:
        """A graceful shutdown under write-back: queue every cached prefix's blocks and state."""
        if self.store is not None and self.store.write_back:
            for node in self.cache.nodes():
                if node.state is not None or (not self.track_states and not node.children):
                    self._write_back(node)

    def cache_prompt(self, req: Req) -> None:
        """The prefill is complete: share its KV through the tree (a tombstone path, its state keeps
        advancing in the request's slot), so requests arriving while it decodes find the branch point."""
        if self.cache_enabled and req.computed > req.tree_len:
            node = self.cache.insert(req.tokens, req.computed, req.kv_slots, req.tree_len, None)
            self._move_prefix(req, node)
            if not self.track_states:  # every block end resumes: store the prompt's blocks
                self.store_prefix(req, None)

    def _move_prefix(self, req: Req, node: TreeNode) -> None:
        assert req.node is not None
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.node = node
        tree_kv = self.cache.path_kv(node)
        if req.kv_slots[: node.end] != tree_kv:  # insert freed own slots the tree already had
            req.forget_sent()
        req.kv_slots[: node.end] = tree_kv
        req.tree_len = node.end

    # ------------------------------------------------------------------ giving back
    def release(self, req: Req, donate: bool, keep: bool = False) -> None:
        """Give back everything a running request holds; with `donate`, its computed KV and its state
        (which is the state after `computed` positions) move into the tree without a copy; `keep` marks
        them as a retracted request's progress (evicted last)."""
        cache = self.cache
        if req.cow_node is not None:
            cache.unlock_state(req.cow_node)
            req.cow_node = None
        n = req.computed
        if donate and self.cache_enabled and req.node is not None and n > 0:
            if not self.track_states:  # every block end resumes: store what it computed (output too)
                self.store_prefix(req, None)
            own_extra = req.kv_slots[n:]
            cache.insert(req.tokens, n, req.kv_slots, req.tree_len, req.state_slot, keep)
            self.kv_alloc.free_many(own_extra)
        else:
            self.kv_alloc.free_many(req.kv_slots[req.tree_len :])
            if req.state_slot is not None:
                self.state_alloc.free(req.state_slot)
        if req.node is not None:
            cache.unlock(req.node)
        self._return_backup(req)
        req.kv_slots, req.tree_len, req.node, req.state_slot = [], 0, None, None
        req.computed, req.splits, req.pending_ckpt, req.peek = 0, [], False, None
        req.store_checked = False
        req.forget_sent()

    def end_kept_progress(self, req: Req) -> None:
        """A waiting request leaves for good: the progress it kept when it was retracted (if it was)
        loses its eviction head start, which ends where it was retracted."""
        if req.retracted_at >= 0 and self.cache_enabled:
            self.cache.unkeep(req.tokens, req.retracted_at)

    # ------------------------------------------------------------------ loads from the state store
    def find_stored(self, req: Req, peek: PeekResult) -> StoredPrefix | None:
        """The deepest stored prefix of the request past its memory match (asked once per wait)."""
        if self.store is None or req.store_checked or not self.uses_cache(req):
            return None
        req.store_checked = True
        if req.store_keys is None:
            req.store_keys = BlockKeys()
        return self.store.lookup(req.store_keys, req.tokens, peek.prefix_len, len(req.tokens) - 1)

    def start_load(self, req: Req, peek: PeekResult, found: StoredPrefix) -> LoadTicket | str:
        """Lock the memory match and take the slots the load fills; the ticket, or the refusal reason
        ("kv", "mamba_state") with everything undone."""
        assert self.store is not None and peek.epoch == self.cache.epoch and found.start == peek.prefix_len
        cache = self.cache
        cache.lock(peek.node)
        state = None
        if self.track_states:
            state = cache.alloc_state()
            if state is None:
                cache.unlock(peek.node)
                return "mamba_state"
        kv = cache.alloc_kv(found.end - found.start)
        if kv is None:
            if state is not None:
                self.state_alloc.free(state)
            cache.unlock(peek.node)
            return "kv"
        keys = [*found.kv_keys, *([found.state_key] if found.state_key else [])]
        return LoadTicket(self.store.next_load_id(), req.rid, peek.node, found.start, found.end, kv, state, keys)

    def store_load_message(self, ticket: LoadTicket, found: StoredPrefix) -> StoreLoad:
        assert self.store is not None
        return self.store.load_message(ticket, found)

    def finish_load(self, req: Req, ticket: LoadTicket, loaded: bool) -> None:
        """The load's result: its prefix joins the tree (the slots pass to it), or its slots are freed."""
        cache = self.cache
        if loaded:
            prefix = cache.path_kv(ticket.node)
            cache.insert(req.tokens, ticket.end, prefix + ticket.kv_slots, ticket.start, ticket.state_slot)
        else:
            self.kv_alloc.free_many(ticket.kv_slots)
            if ticket.state_slot is not None:
                self.state_alloc.free(ticket.state_slot)
            if self.store is not None:
                self.store.forget(ticket.keys)
        cache.unlock(ticket.node)
        req.peek = None

    # ------------------------------------------------------------------ the cache as a whole
    def drop_checkpoints(self, ckpt_nodes: list[tuple[TreeNode, int]]) -> None:
        """A failed step did not fill these checkpoint slots: take them out of the tree."""
        for node, slot in ckpt_nodes:
            self.cache.drop_state(node, slot)

    def flush(self) -> None:
        """Empty the cache (callers ensure no running request holds a lock on it)."""
        self.cache.flush()
