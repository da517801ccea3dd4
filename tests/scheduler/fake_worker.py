"""A pure-Python stand-in for the worker that *checks* the scheduler's slot bookkeeping.

KV slot i holds (position, token); a state slot holds the exact tuple of tokens it has absorbed. Each
slice is verified before it runs: its prefix KV slots must hold positions 0..start-1 and its state slot
must hold exactly the tokens those KV slots hold. The next token is a deterministic function of the
state, so outputs depend only on the token sequence (never on slots, batching or caching), exactly
like greedy decoding of a real model. Same `step(batch, refused)` interface as worker_proc's ModelRunner.

LoRA adapters: `lora` is what each adapter slot holds (a uid, from ForwardBatch.lora_loads). A slice under
slot s absorbs its tokens tagged with s's adapter (`tagged`: token + tag(uid) * TAG), so the next token
depends on the adapter, a prefix computed under another adapter (or the base) is a SlotError, and a slice
whose slot holds no adapter, or not the one `expect[rid]` names, is a SlotError.
"""

from __future__ import annotations

import hashlib

from shared.messages import ForwardBatch, ReqSlice, StepResult

TAG = 1_000_000  # above every token id of the tests' vocabularies


def tag(uid: str) -> int:
    """The adapter's tag in the tokens it absorbed (0: the base model)."""
    return int(hashlib.sha256(uid.encode()).hexdigest()[:6], 16) + 1 if uid else 0


class SlotError(AssertionError):
    """The scheduler handed the worker inconsistent slots."""


class FakeWorker:
    def __init__(self, kv_slots: int, state_slots: int, vocab: int = 50, eos: int | None = None) -> None:
        self.kv: list[tuple[int, int] | None] = [None] * (kv_slots + 1)
        self.state: list[tuple[int, ...] | None] = [None] * (state_slots + 1)
        self.vocab = vocab
        self.eos = eos
        self.steps = 0
        # like worker_proc's KVSlotMirror: full slot lists of the rids that ran in batch `mirror_step`
        self.mirror: dict[str, list[int]] = {}
        self.mirror_step: int | None = None
        self.lora: dict[int, str] = {}  # adapter slot -> the uid it holds
        self.expect: dict[str, str] = {}  # rid -> the uid its slices must run under (tests fill it)
        self.ran_under: dict[str, int] = {}  # rid -> its adapter slot in the previous batch

    def next_token(self, seq: tuple[int, ...]) -> int:
        h = 0
        for t in seq[-8:]:
            h = (h * 1000003 + t + 7) % 2_147_483_647
        tok = (h + len(seq)) % self.vocab
        return tok

    def step(self, batch: ForwardBatch, refused: frozenset[str] = frozenset()) -> StepResult:
        self.steps += 1
        for op in batch.copies:
            if op.rid is not None and op.rid in refused:
                continue
            if self.state[op.src] is None:
                raise SlotError(f"copy from unwritten state slot {op.src}")
            self.state[op.dst] = self.state[op.src]
        for slot in batch.clears:
            self.state[slot] = ()
        for load in batch.lora_loads:
            if load.slot < 1 or any(s.lora_slot == load.slot == self.ran_under.get(s.rid) for s in batch.reqs):
                raise SlotError(f"adapter slot {load.slot} loaded under a request running with it")
            self.lora[load.slot] = load.adapter.uid
        out: dict[str, int] = {}
        accepted: dict[str, int] = {}
        guesses: dict[str, list[int]] = {}
        full_kv = self._resolve(batch, refused)
        backups = [s.backup_slot for s in batch.reqs if s.drafts and s.rid not in refused]
        if any(not 0 < b < len(self.state) for b in backups) or len(set(backups)) != len(backups):
            raise SlotError(f"bad backup state slots {backups}")
        for s in batch.reqs:
            if s.rid in refused:
                continue
            kv_slots = full_kv[s.rid]
            t = self._adapter_tag(s)
            self._check_prefix(s.rid, kv_slots, s.start_pos, s.state_slot, t)
            seq = tuple(self.kv[slot][1] for slot in kv_slots[: s.start_pos])  # type: ignore[index]
            ids = [tok + t * TAG for tok in s.input_ids]
            for i, tok in enumerate(ids):
                self.kv[kv_slots[s.start_pos + i]] = (s.start_pos + i, tok)
            n_in = len(ids) - s.drafts
            seq = seq + tuple(ids[:n_in])
            n_ok = 0
            while n_ok < s.drafts and self.next_token(seq) == s.input_ids[n_in + n_ok] != self.eos:
                seq, n_ok = seq + (ids[n_in + n_ok],), n_ok + 1
            if s.drafts:
                accepted[s.rid] = n_ok
                self.state[s.backup_slot] = None  # what the worker leaves there is no state of anyone's
            if s.state_slot:
                self.state[s.state_slot] = seq
            if s.sample:
                out[s.rid] = self.next_token(seq)
                if s.draft_next:
                    guesses[s.rid] = self.guess(seq + (out[s.rid],), s.draft_next)
        self.ran_under = {s.rid: s.lora_slot for s in batch.reqs if s.lora_slot}
        hit = sorted(r for r in refused if any(s.rid == r for s in batch.reqs))
        return StepResult(step=batch.step, next_tokens=out, refused=hit, accepted=accepted, drafts=guesses)

    def guess(self, seq: tuple[int, ...], k: int) -> list[int]:
        """The MTP layers' `k` guesses after `seq` (ReqSlice.draft_next): none here."""
        return []

    def _adapter_tag(self, s: ReqSlice) -> int:
        """The tag of the adapter `s` runs under; a SlotError when its slot holds none or the wrong one."""
        if s.lora_slot and s.lora_slot not in self.lora:
            raise SlotError(f"{s.rid}: adapter slot {s.lora_slot} holds no adapter")
        uid = self.lora[s.lora_slot] if s.lora_slot else ""
        if s.rid in self.expect and self.expect[s.rid] != uid:
            raise SlotError(f"{s.rid}: runs under {uid or 'the base model'!r}, expected {self.expect[s.rid]!r}")
        return tag(uid)

    def _resolve(self, batch: ForwardBatch, refused: frozenset[str]) -> dict[str, list[int]]:
        """Full KV slot lists of the slices that run; the mirror then holds exactly these."""
        held = self.mirror if self.mirror_step is not None and batch.step == self.mirror_step + 1 else {}
        full: dict[str, list[int]] = {}
        for s in batch.reqs:
            if s.rid in refused:
                continue
            prior = held.get(s.rid, [])
            if len(prior) < s.kv_reuse or s.kv_reuse + len(s.kv_slots) != s.start_pos + len(s.input_ids):
                raise SlotError(f"{s.rid}: kv_reuse {s.kv_reuse} with {len(prior)} mirrored slots")
            full[s.rid] = prior[: s.kv_reuse] + s.kv_slots
        self.mirror, self.mirror_step = full, batch.step
        return full

    def _check_prefix(self, rid: str, kv_slots: list[int], start: int, state_slot: int, t: int = 0) -> None:
        if len(set(kv_slots)) != len(kv_slots) or 0 in kv_slots:
            raise SlotError(f"{rid}: kv slots repeat or use the padding slot")
        toks = []
        for pos in range(start):
            entry = self.kv[kv_slots[pos]]
            if entry is None or entry[0] != pos:
                raise SlotError(f"{rid}: kv slot {kv_slots[pos]} holds {entry}, expected position {pos}")
            if entry[1] // TAG != t:
                raise SlotError(f"{rid}: kv slot {kv_slots[pos]} was computed under another adapter")
            toks.append(entry[1])
        if state_slot:
            state = self.state[state_slot]
            if state != tuple(toks):
                raise SlotError(f"{rid}: state slot {state_slot} holds {state!r:.80} but KV holds {len(toks)} tokens")
