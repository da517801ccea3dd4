"""The scheduler's side of the state store: which stored prefixes a request can load, which blocks and
states to write, and the metadata of the loads in flight (docs/architecture.md, "State store").

Owns the block keys (computed in rank 0's chain namespace, `StoreNamespace.chain`), the set of keys
already sent for writing (bounded, so the same block is not written again and again), the writes
waiting for the next batch and the id of the next load. It decides nothing about slots: a load's
slots are taken by `ReqResources` under admission's budget, and the tree takes them back when the
load's result is applied.

Rules:
- A stored state resumes at a block's end: writes name a state only at a multiple of the block size,
  and a load ends there. A load never ends past `limit` (the prompt's last token is always computed,
  so that its logits exist: the state that resumes is the one *before* it, never one that contains it).
- A lookup asks the store (`contains`, a hint) once per block at most; `get` on the workers is the
  authority, and a load that finds an entry missing or damaged fails and the prefix is computed.
- Writes are sent in the batch built in the round they are queued in, and the workers read the slots
  before the batch runs: every slot a write names holds the data the write describes until then.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_proc.radix_node import TreeNode
from shared.messages import StoreLoad, StoreWrite
from shared.state_store.keys import StoreNamespace, block_key, root_key, state_key

logger = logging.getLogger(__name__)

WRITTEN_KEYS_KEPT = 1 << 20


@dataclass(frozen=True, slots=True)
class StoredPrefix:
    """What a lookup found: positions [start, end) can be loaded (start: the memory match's end)."""

    start: int
    end: int
    first_block: int
    kv_keys: list[str]
    state_key: str


@dataclass(slots=True)
class LoadTicket:
    """A load in flight: the request waiting for it, the memory match it extends (KV-locked), the
    slots it fills (owned by the ticket until the result is applied)."""

    load_id: int
    rid: str
    node: TreeNode
    start: int
    end: int
    kv_slots: list[int]
    state_slot: int | None
    keys: list[str]  # the entries it reads (forgotten as written when it fails)


class BlockKeys:
    """A token sequence's block keys, extended as far as asked (kept on the request: its tokens
    only ever grow)."""

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: list[str] = []

    def upto(self, tokens: list[int], blocks: int, block: int, root: str) -> list[str]:
        keys = self.keys
        parent = keys[-1] if keys else root
        for i in range(len(keys), blocks):
            parent = block_key(parent, tokens[i * block:(i + 1) * block])
            keys.append(parent)
        return keys[:blocks]


class StoreTier:
    def __init__(self, namespace: StoreNamespace, contains: Callable[[str], bool], block: int, has_kv: bool,
                 has_state: bool, write_back: bool) -> None:  # fmt: skip
        self.namespace = namespace
        self.root = root_key(namespace.chain())
        self.contains = contains
        self.block = block
        self.has_kv = has_kv
        self.has_state = has_state
        self.write_back = write_back
        self.written: OrderedDict[str, None] = OrderedDict()
        self.pending: list[StoreWrite] = []
        self.clear_pending = False  # the next batch empties the store
        self._ids = itertools.count(1)

    def next_load_id(self) -> int:
        return next(self._ids)

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: BlockKeys, tokens: list[int], start: int, limit: int) -> StoredPrefix | None:
        """The deepest stored prefix of tokens[:limit] that ends past `start` (the memory match)."""
        b = self.block
        blocks = limit // b
        if blocks * b <= start:
            return None
        chain = keys.upto(tokens, blocks, b, self.root)
        first = start // b
        end_block = first
        if self.has_kv:
            while end_block < blocks and self._present(chain[end_block]):
                end_block += 1
        else:
            end_block = blocks
        for j in range(end_block, first, -1):
            if j * b <= start:
                break
            skey = state_key(chain[j - 1]) if self.has_state else ""
            if skey and not self._present(skey):
                continue
            return StoredPrefix(start, j * b, first, chain[first:j] if self.has_kv else [], skey)
        return None

    def _present(self, key: str) -> bool:
        """Sent for writing (the workers read a queued entry as a stored one), or in the store (the
        probe never raises: False when it cannot tell)."""
        return key in self.written or self.contains(key)

    def load_message(self, ticket: LoadTicket, found: StoredPrefix) -> StoreLoad:
        skip = found.start - found.first_block * self.block
        return StoreLoad(load_id=ticket.load_id, kv_keys=found.kv_keys, skip=skip,
                         kv_slots=ticket.kv_slots, state_key=found.state_key,
                         state_slot=ticket.state_slot or 0)  # fmt: skip

    # ------------------------------------------------------------------ writes
    def write(self, keys: BlockKeys, tokens: list[int], kv_slots: list[int], end: int, state_slot: int | None) -> bool:
        """Queue the blocks of tokens[:end] not written yet and (end a block's end) the state in
        `state_slot`, the state after them. Returns whether anything was queued."""
        b = self.block
        blocks = end // b
        if blocks == 0:
            return False
        chain = keys.upto(tokens, blocks, b, self.root)
        kv_keys: list[str] = []
        slots: list[int] = []
        if self.has_kv:
            for i, key in enumerate(chain):
                if key not in self.written:
                    kv_keys.append(key)
                    slots.extend(kv_slots[i * b:(i + 1) * b])
        skey = ""
        if self.has_state and state_slot is not None and end % b == 0:
            skey = state_key(chain[-1])
            if skey in self.written:
                skey = ""
        if not kv_keys and not skey:
            return False
        for key in [*kv_keys, *([skey] if skey else [])]:
            self._remember(key)
        self.pending.append(StoreWrite(kv_keys=kv_keys, kv_slots=slots, state_key=skey,
                                       state_slot=state_slot if skey and state_slot is not None else 0))
        return True

    def _remember(self, key: str) -> None:
        self.written[key] = None
        self.written.move_to_end(key)
        if len(self.written) > WRITTEN_KEYS_KEPT:
            self.written.popitem(last=False)

    def forget(self, keys: list[str]) -> None:
        """These keys were found missing: a later write may store them again."""
        for key in keys:
            self.written.pop(key, None)

    def clear(self) -> None:
        """Empty the store with the next batch: nothing queued is written, every block may be again."""
        self.clear_pending = True
        self.pending.clear()
        self.written.clear()

    def take_writes(self) -> list[StoreWrite]:
        out, self.pending = self.pending, []
        return out
