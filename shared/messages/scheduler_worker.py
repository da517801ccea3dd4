"""The two channels between a scheduler and its worker ranks (shared/channels.py): `ToWorker`
(SCHEDULER_TO_WORKER, one socket per rank: the batch to run, the stop, the idle heartbeat) and
`ToSchedulerFromWorker` (WORKER_TO_SCHEDULER: each rank's readiness, rank 0's StepResult). The
scheduler owns every slot number and decides what each step computes, copies, clears, stores and
loads; the workers only carry it out, and a step either runs whole or is refused (per request) or
fails (StepResult.error). At most one ForwardBatch is in flight."""

from __future__ import annotations

import msgspec

from shared.messages.images import ImageInput
from shared.messages.lora import LoraAdapter
from shared.messages.sampling import SamplingParams
from shared.messages.server_info import StoreStats


# ---------------------------------------------------------------- scheduler -> workers
class CopyOp(msgspec.Struct, array_like=True):
    """Copy Mamba state (conv + ssm) of slot `src` into slot `dst` before the forward pass.
    `rid` is set for a request's copy-on-write (the worker may refuse it, which refuses the
    request for this step); None for a cache checkpoint (never refused)."""

    src: int
    dst: int
    rid: str | None = None


class ReqSlice(msgspec.Struct, kw_only=True, array_like=True):
    """The part of one request computed in this step.

    `input_ids` are the tokens at positions [start_pos, start_pos + len(input_ids)).
    `kv_slots` holds the KV slot of every position [kv_reuse, start_pos + len(input_ids)): the
    prefix slots (already written) followed by the slots this step writes.
    `kv_reuse`: the first kv_reuse slots are not sent; the worker takes them from its own copy of
    this rid's full slot list in the previous ForwardBatch (step - 1), which it must hold with at
    least kv_reuse slots, else the step fails. 0: kv_slots is complete. The scheduler sends > 0 only
    for a request that ran (not refused) in the previous batch, that step did not fail, and whose
    slots [0, kv_reuse) are unchanged since.
    `state_slot` holds the recurrent state after position start_pos - 1 (zeros if start_pos
    is 0 and the slot was cleared); the step advances it in place.
    `sample`: produce a next token after the last input token (False for a non-final chunk).
    `drafts` > 0 (a speculative verify slice): the last `drafts` input tokens are guesses; the worker
    samples after every input position, accepts the longest prefix of guesses its samples agree with
    (StepResult.accepted) and leaves state_slot at the state after the accepted tokens, using
    `backup_slot` (a free state slot the scheduler lends for the step) to hold the state before it.
    `draft_next` > 0 (--speculative-algorithm NEXTN, sampling slices): after sampling, the worker's MTP
    layers guess this many tokens to follow the sampled one (StepResult.drafts). With NEXTN every slice
    also runs the MTP layers over its rows, which needs the token after each row: the next input, the
    sampled token, or for a non-final prompt chunk `prompt_next`.
    """

    rid: str
    input_ids: list[int]
    start_pos: int
    kv_slots: list[int]
    state_slot: int
    sample: bool
    sampling: SamplingParams | None = None
    output_len: int = 0  # tokens generated so far (seeds sampling deterministically)
    kv_reuse: int = 0  # leading KV slots taken from the worker's copy of the previous batch
    # with sampling.needs_history (sampling slices only): every token so far, prompt then output
    history: list[int] | None = None
    # >= 0 (prompt slices of a request with prompt_logprobs): return the logprob of each next token
    # at every position of the slice, with this many alternatives; `prompt_next` is the prompt token
    # after the slice (-1 when the slice reaches the end of the prompt), sent too for every slice that
    # does not sample when the MTP layers run (draft_next)
    prompt_logprobs: int = -1
    prompt_next: int = -1
    drafts: int = 0
    backup_slot: int = 0
    draft_next: int = 0
    # the request's images whose tokens overlap [start_pos, start_pos + len(input_ids)) (those rows take
    # the vision tower's output instead of the token embedding), and the rotary offset of a text token at
    # start_pos (shared/images.py rope_delta over every image of the request)
    images: list[ImageInput] = []
    rope_delta: int = 0
    lora_slot: int = 0  # the adapter slot whose adapter the slice runs under (0 = the base model)


class StoreWrite(msgspec.Struct, kw_only=True, array_like=True):
    """Store a prefix's blocks and the state after them (docs/architecture.md, "State store"). Read
    from the slots as they are when the batch arrives, before any of its copies, clears, loads or its
    forward pass: block `kv_keys[i]` is the KV of `kv_slots[i * B:(i + 1) * B]` (B =
    --state-cache-block-tokens); `state_key` (when set) names the recurrent state in `state_slot`,
    the state after the last of those tokens."""

    kv_keys: list[str]
    kv_slots: list[int]
    state_key: str = ""
    state_slot: int = 0


class StoreLoad(msgspec.Struct, kw_only=True, array_like=True):
    """Load stored blocks (and the state after the last) into free slots: the entries are read in the
    background, and the slots written before the forward pass of the step whose StepResult reports the
    load done (StepResult.store_done). The blocks `kv_keys` cover positions [first, end) of a prefix;
    their first `skip` tokens are not written (the cache holds them), `kv_slots` takes every other
    position in order (a model without attention stores no KV: no blocks, and the slots are only the
    scheduler's bookkeeping of positions [end - len(kv_slots), end)).
    `state_key` / `state_slot`: the state at `end`. A load that fails on any rank
    (an entry missing, damaged, or of another shape) is in StepResult.store_failed: its slots hold
    nothing and the prefix is computed instead. A batch without requests waits up to 50 ms for a
    pending load (the scheduler sends one to poll while loads are pending and nothing else runs)."""

    load_id: int
    kv_keys: list[str]
    skip: int
    kv_slots: list[int]
    state_key: str = ""
    state_slot: int = 0


class LoraLoad(msgspec.Struct, kw_only=True, array_like=True):
    """Put `adapter` in adapter slot `slot` (1..--max-loras-per-batch) before the forward pass, replacing what
    the slot held; the scheduler sends it only for a slot no request of this batch or an earlier unfinished
    one uses otherwise. A rank that cannot read it fails the step (StepResult.error)."""

    slot: int
    adapter: LoraAdapter


class ForwardBatch(msgspec.Struct, tag=True, kw_only=True):
    step: int
    reqs: list[ReqSlice]
    copies: list[CopyOp] = []
    clears: list[int] = []  # state slots to zero before the forward pass (after copies)
    # requests ended since the previous batch for which rank 0 holds state of its own (a grammar
    # matcher): it is dropped before this batch runs (a rid in `reqs` too is a new request reusing it)
    ended: list[str] = []
    store_writes: list[StoreWrite] = []
    store_loads: list[StoreLoad] = []
    store_clear: bool = False  # empty the state store (after this batch's writes were queued: they go too)
    lora_loads: list[LoraLoad] = []


class Shutdown(msgspec.Struct, tag=True, kw_only=True):
    reason: str = ""


class Heartbeat(msgspec.Struct, tag=True, kw_only=True):
    """Sent by an idle scheduler about once a second so that workers (on other nodes too)
    notice a dead node 0 within the watchdog timeout."""


ToWorker = ForwardBatch | Shutdown | Heartbeat


# ---------------------------------------------------------------- workers -> scheduler
class WorkerReady(msgspec.Struct, tag=True, kw_only=True):
    rank: int
    kv_slots: int  # usable token slots (slot 0, padding, not counted)
    state_slots: int  # usable state slots (slot 0, padding, not counted)
    device: str
    dtype: str
    # the canonical JSON of the rank's state store namespace (shared/state_store/keys.py) when the
    # server has a state store, else ""; rank 0's names the block keys the scheduler computes
    store_namespace: str = ""


class WorkerStarting(msgspec.Struct, tag=True, kw_only=True):
    """A rank still starting says so about once a second (worker_proc/startup_beacon.py): the scheduler
    counts --startup-timeout from a rank's last word, so a long first start (kernels compiled, weights
    loaded, an execution plan measured) is not taken for a missing rank. Ignored once the rank is ready."""

    rank: int
    phase: str
    elapsed_s: float


class StepResult(msgspec.Struct, tag=True, kw_only=True):
    """Reply of rank 0 to a ForwardBatch. `next_tokens[rid]` for every request that sampled
    and was not refused. `refused` lists requests whose copy-on-write was refused (agreed by
    every rank); their slices did not run and their slots were not written."""

    step: int
    next_tokens: dict[str, int] = {}
    # per sampling slice that asked: the logprob (and alternatives) of each token it emits, in order:
    # one for a plain slice, its accepted drafts and then its next_tokens entry for a verify slice
    logprobs: dict[str, list[float]] = {}
    top_logprobs: dict[str, list[list[tuple[int, float]]]] = {}
    # per prompt-logprob slice: the logprob of the token after each of its positions, and alternatives
    prompt_logprobs: dict[str, list[float]] = {}
    prompt_top_logprobs: dict[str, list[list[tuple[int, float]]]] = {}
    prompt_ranks: dict[str, list[int]] = {}  # the rank of each of those tokens in its distribution
    grammar_done: list[str] = []  # requests whose grammar is complete with this step's token
    grammar_errors: dict[str, str] = {}  # requests whose grammar could not go on (they end with an error)
    # of grammar_errors: those whose constraint itself left no token they may sample (no text satisfies
    # it, or it is complete while min_tokens blocks the stop tokens): the client's fault, ended as rejected
    grammar_rejected: list[str] = []
    refused: list[str] = []
    # per verify slice (ReqSlice.drafts > 0): how many of its drafts were accepted; its next_tokens
    # entry is the token sampled after the last accepted one
    accepted: dict[str, int] = {}
    # per slice with draft_next: the MTP layers' guesses of the tokens after its next_tokens entry
    drafts: dict[str, list[int]] = {}
    error: str | None = None
    elapsed_s: float = 0.0
    # StoreLoad.load_id of the loads this step settled: done (the slots hold the prefix) or failed on some
    # rank (the slots hold nothing); a load in neither is still being read (its slots stay the ticket's)
    store_done: list[int] = []
    store_failed: list[int] = []
    store: StoreStats | None = None  # rank 0's state store, when the server has one
    # images of this step's slices rank 0's vision tower encoded, and those its encoder cache served
    images_encoded: int = 0
    images_cached: int = 0


ToSchedulerFromWorker = WorkerReady | WorkerStarting | StepResult
