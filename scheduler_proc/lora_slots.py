"""LoraSlots: which LoRA adapters the scheduler knows, and which one sits in which adapter slot.

Owner: the Scheduler (one table per replica). The tokenizer registers adapters (LoadLoraReq) and forgets
them (UnloadLoraReq); the workers hold the adapter weights of `--max-loras-per-batch` slots (1..N; slot 0
is the base model) and load one into a slot when a batch says so (ForwardBatch.lora_loads).

What must hold:
- a RUNNING request's adapter sits in a slot, and that slot does not change while any request using it
  runs (`running` > 0 pins it);
- admission places a request's adapter (`place`) only after `can_place` said yes: a free slot first, then
  the least recently used slot whose adapter no running request uses; when every slot is pinned the
  request is refused for this round like a memory refusal (reason "lora_slot", retry.py's latch: a slot is
  unpinned only when a running request leaves the running set, which changes `running_version`);
- an adapter being unloaded takes no new request (`lookup` does not find it; a new adapter may take its
  name at once); the requests it has keep their `AdapterUse` and finish under it; it is dropped, and its
  slot freed, when the last of them ends (`detach`);
- the cache namespace of a request is its adapter's `uid`, never its name (`namespace_token`), so an
  adapter replaced under the same name never matches the old one's prefixes.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from shared.messages import LoraAdapter, LoraLoad

logger = logging.getLogger(__name__)

_KEY_BITS = 60
_KEY_BASE = -(1 << _KEY_BITS) - 1  # below every image key token (shared/images.py key_token >= -2**60)


def namespace_token(uid: str, first: int) -> int:
    """The cache-key id of the first prompt position of a request under the adapter `uid` whose first key
    token is `first`: a negative id no vocabulary and no image key holds, so that each adapter's prompts
    live in their own subtree of the radix tree (and their own block-key chains in the state store)."""
    digest = hashlib.sha256(f"{uid}\0{first}".encode()).hexdigest()
    return _KEY_BASE - int(digest[: _KEY_BITS // 4], 16)


@dataclass(eq=False)
class AdapterUse:
    """One registered adapter: its slot (0: none), its requests in the scheduler (waiting, loading,
    running), those running, whether it is being unloaded, and when a batch last used its slot."""

    adapter: LoraAdapter
    slot: int = 0
    requests: int = 0
    running: int = 0
    unloading: bool = False
    last_used: int = 0


class HoldsAdapter(Protocol):
    """What the integrity check reads of a request (scheduler_proc.request.Req)."""

    rid: str
    lora: AdapterUse | None


class LoraSlots:
    """The adapter table and the slot assignment (module docstring)."""

    def __init__(self, max_slots: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.by_name: dict[str, AdapterUse] = {}
        self.draining: list[AdapterUse] = []  # unloaded, with requests still to finish
        self.slots: list[AdapterUse | None] = [None] * (max_slots + 1)  # index 0 unused: the base model
        self._clock = 0

    # ------------------------------------------------------------------ the table
    def load(self, adapter: LoraAdapter) -> str:
        """Register `adapter` under its name; "" or why not."""
        if not self.enabled:
            return "LoRA adapters are off: start the server with --enable-lora"
        if adapter.name in self.by_name:
            return f"the LoRA adapter {adapter.name!r} is loaded already (unload it first)"
        self.by_name[adapter.name] = AdapterUse(adapter)
        logger.info("LoRA adapter %s registered (uid %s, rank %d)", adapter.name, adapter.uid, adapter.rank)
        return ""

    def unload(self, name: str) -> str:
        """Forget `name` for new requests; "" or why not. Its requests finish under it."""
        use = self.by_name.pop(name, None)
        if use is None:
            return f"the LoRA adapter {name!r} is not loaded"
        use.unloading = True
        if use.requests:
            self.draining.append(use)
        else:
            self._drop(use)
        return ""

    def lookup(self, name: str) -> AdapterUse | None:
        return self.by_name.get(name)

    def attach(self, use: AdapterUse) -> None:
        """A request naming `use` entered the scheduler."""
        use.requests += 1

    def detach(self, use: AdapterUse) -> None:
        """A request naming `use` left the scheduler; the last one of an unloaded adapter drops it."""
        use.requests -= 1
        if use.unloading and not use.requests:
            self.draining.remove(use)
            self._drop(use)

    def _drop(self, use: AdapterUse) -> None:
        if use.slot:
            self.slots[use.slot] = None
            use.slot = 0
        logger.info("LoRA adapter %s (uid %s) unloaded", use.adapter.name, use.adapter.uid)

    # ------------------------------------------------------------------ slots
    def _victim(self) -> int:
        """The slot a new adapter may take: a free one, else the least recently used unpinned one (0: none)."""
        best, best_used = 0, 0
        for s in range(1, len(self.slots)):
            use = self.slots[s]
            if use is None:
                return s
            if not use.running and (not best or use.last_used < best_used):
                best, best_used = s, use.last_used
        return best

    def can_place(self, use: AdapterUse) -> bool:
        return bool(use.slot) or bool(self._victim())

    def place(self, use: AdapterUse) -> LoraLoad | None:
        """Make sure `use` sits in a slot (after `can_place`); the LoraLoad the batch must carry, if any."""
        self._clock += 1
        use.last_used = self._clock
        if use.slot:
            return None
        s = self._victim()
        assert s, f"no adapter slot for {use.adapter.name} (can_place was not asked)"
        old = self.slots[s]
        if old is not None:
            old.slot = 0
        self.slots[s], use.slot = use, s
        return LoraLoad(slot=s, adapter=use.adapter)

    def started(self, use: AdapterUse) -> None:
        assert use.slot, f"{use.adapter.name} runs without a slot"
        use.running += 1

    def stopped(self, use: AdapterUse) -> None:
        use.running -= 1

    def forget_slots(self, slots: Iterable[int]) -> None:
        """The workers may not hold what these slots were to be loaded with (a failed step): empty them."""
        for s in slots:
            use = self.slots[s]
            if use is not None and not use.running:  # a running one was loaded by an earlier step
                use.slot = 0
                self.slots[s] = None

    def in_slots(self) -> int:
        return sum(use is not None for use in self.slots)

    def check_integrity(self, table: Iterable[HoldsAdapter], running: Iterable[HoldsAdapter]) -> None:
        """Counts match the requests (`table`: every request the scheduler holds; `running`: the running
        ones), slots and uses point at each other, every running request's adapter sits in a slot."""
        requests: dict[int, int] = {}
        runs: dict[int, int] = {}
        uses = {id(u): u for u in [*self.by_name.values(), *self.draining]}
        for r in table:
            if r.lora is not None:
                assert id(r.lora) in uses, f"{r.rid} names an adapter the table dropped"
                requests[id(r.lora)] = requests.get(id(r.lora), 0) + 1
        for r in running:
            if r.lora is not None:
                assert r.lora.slot, f"{r.rid} runs without its adapter in a slot"
                runs[id(r.lora)] = runs.get(id(r.lora), 0) + 1
        for name, use in self.by_name.items():
            assert use.adapter.name == name and not use.unloading, name
        for use in self.draining:
            assert use.unloading and use.requests > 0, f"{use.adapter.name} drains with no request"
        for key, use in uses.items():
            assert use.requests == requests.get(key, 0), f"{use.adapter.name}: {use.requests} requests counted"
            assert use.running == runs.get(key, 0), f"{use.adapter.name}: {use.running} running counted"
            assert not use.slot or self.slots[use.slot] is use, f"{use.adapter.name}: slot {use.slot} not its"
        for s, use in enumerate(self.slots):
            assert use is None or (s and use.slot == s and id(use) in uses), f"slot {s} holds a stale adapter"
