"""BatchBuilder: collects one round's slices and state ops into a ForwardBatch, and remembers what
it sent (`InFlight`) so the StepResult can be applied or rolled back slice by slice. A slice sends
only the KV slots the workers do not hold from the previous batch (`Req.kv_reuse`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler_proc.request import Req
from shared.messages import CopyOp, ForwardBatch, LoraLoad, ReqSlice, StoreLoad, StoreWrite

if TYPE_CHECKING:
    from scheduler_proc.radix_node import TreeNode
    from scheduler_proc.store_tier import LoadTicket


@dataclass(slots=True)
class SliceEntry:
    req: Req
    start: int  # first position computed
    n: int  # positions computed: [start, start + n)
    sample: bool
    prefill: bool  # prompt (or recomputed) tokens, not the one decode token
    admitted: bool  # the request was admitted in this round (a refusal sends it back to waiting)
    drafts: list[int] = field(default_factory=list)  # guessed tokens after the decode token (drafting.py)
    draft_next: int = 0  # tokens the worker's MTP layers guess after this slice's sampled token


@dataclass(slots=True)
class InFlight:
    step: int
    entries: list[SliceEntry]
    by_rid: dict[str, SliceEntry]
    ckpt_nodes: list[tuple[TreeNode, int]]  # (node, slot) of each checkpoint this step's copies fill
    lora_slots: list[int] = field(default_factory=list)  # adapter slots this step loads (ForwardBatch.lora_loads)


@dataclass
class BatchBuilder:
    """Rule: checkpoint copies come before copy-on-write copies in `copies` (a checkpoint slot saved
    this round may be a CoW source this round; workers apply copies in list order), and clears apply
    after all copies (shared/messages/scheduler_worker.py)."""

    step: int
    next_token_inputs: bool = False  # the MTP layers run: every slice that does not sample says its next token
    entries: list[SliceEntry] = field(default_factory=list)
    ckpt_copies: list[CopyOp] = field(default_factory=list)
    cow_copies: list[CopyOp] = field(default_factory=list)
    clears: list[int] = field(default_factory=list)
    ckpt_nodes: list[tuple[TreeNode, int]] = field(default_factory=list)
    loads: list[LoadTicket] = field(default_factory=list)
    load_messages: list[StoreLoad] = field(default_factory=list)
    store_writes: list[StoreWrite] = field(default_factory=list)
    store_clear: bool = False
    poll: bool = False  # loads are pending: a batch goes out even with nothing else in it
    lora_loads: list[LoraLoad] = field(default_factory=list)  # adapters put in slots before the forward pass

    @property
    def empty(self) -> bool:
        return not (self.entries or self.loads or self.store_writes or self.store_clear or self.poll)

    def add_load(self, ticket: LoadTicket, message: StoreLoad) -> None:
        self.loads.append(ticket)
        self.load_messages.append(message)

    def add(self, req: Req, n: int, prefill: bool, admitted: bool = False) -> None:
        start = req.computed
        assert n >= 1 and start + n <= len(req.tokens) and len(req.kv_slots) == start + n, (req, n)
        self.entries.append(SliceEntry(req, start, n, start + n == len(req.tokens), prefill, admitted))

    def build(self) -> tuple[ForwardBatch, InFlight]:
        reqs = []
        for e in self.entries:
            r = e.req
            reuse = r.kv_reuse(self.step)
            assert reuse <= e.start, (r, reuse)  # reused slots are those of positions already computed
            sp, end = r.sampling, e.start + e.n
            prompt_lp = sp.prompt_logprobs >= 0 and e.start < r.prompt_len - 1
            reqs.append(
                ReqSlice(
                    rid=r.rid,
                    input_ids=r.model_ids(e.start, end) + e.drafts,
                    start_pos=e.start,
                    kv_slots=r.kv_slots[reuse:],
                    state_slot=r.state_slot or 0,
                    sample=e.sample,
                    sampling=r.sampling if e.sample else None,
                    output_len=r.num_output,
                    kv_reuse=reuse,
                    history=r.model_ids(0, len(r.tokens)) if e.sample and sp.needs_history else None,
                    prompt_logprobs=sp.prompt_logprobs if prompt_lp else -1,
                    prompt_next=r.model_ids(end, end + 1)[0] if (prompt_lp and end < r.prompt_len) or (
                        self.next_token_inputs and not e.sample) else -1,
                    drafts=len(e.drafts),
                    backup_slot=(r.backup_slot or 0) if e.drafts else 0,
                    draft_next=e.draft_next,
                    images=r.images_in(e.start, end),
                    rope_delta=r.rope_delta(e.start),
                    lora_slot=r.lora_slot,
                )
            )
        batch = ForwardBatch(
            step=self.step, reqs=reqs, copies=self.ckpt_copies + self.cow_copies, clears=list(self.clears),
            store_writes=list(self.store_writes), store_loads=list(self.load_messages), store_clear=self.store_clear,
            lora_loads=list(self.lora_loads),
        )
        by_rid = {e.req.rid: e for e in self.entries}
        return batch, InFlight(self.step, list(self.entries), by_rid, list(self.ckpt_nodes),
                               [load.slot for load in self.lora_loads])
