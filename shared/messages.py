"""Every message that crosses a process boundary, as tagged msgspec Structs.

One union per channel (see `shared/channels.py`). Decoding is typed: a message of the wrong
shape raises `msgspec.ValidationError` at the receiver instead of being accepted silently.
Token ids travel as msgpack integer arrays (compact varints), never as pickles.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

FinishReason = Literal["stop", "length", "abort", "error"]


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the output (structured output), as the client gave it: validated by the
    tokenizer process, compiled by worker rank 0 (worker_proc/grammar.py, one compilation per
    distinct spec). `source`: the JSON schema (JSON text), the regex or the EBNF grammar (empty for
    json_object); `strict`: a json_schema object allows no properties beyond the schema's; `after`:
    the tokens (a reasoning model's `</think>`) once the output holds which the grammar constrains what
    follows, the output being free until then (empty: constrained from its first token)."""

    kind: Literal["json_schema", "json_object", "regex", "ebnf"]
    source: str = ""
    strict: bool = True
    after: tuple[int, ...] = ()


class ThinkingBudget(msgspec.Struct, frozen=True, kw_only=True):
    """A cap on a reasoning model's thinking (vLLM's `thinking_token_budget`), set by the tokenizer
    process from the reasoning parser's tags: once `tokens` output tokens were made inside the
    reasoning (from the output's start when `inside`, else after the `start` tokens) and it has not
    ended (the `end` tokens), rank 0 forces the `end` tokens one by one (worker_proc/logit_processing.py)."""

    tokens: int
    start: tuple[int, ...]
    end: tuple[int, ...]
    inside: bool = False


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling. Validated by the tokenizer process before a request is accepted."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = all
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives returned beside each sampled token's logprob (0..20)
    # >= 0: the logprob of every prompt token after the first, and this many alternatives at each
    # position (the request then never starts from a cached prefix: every position is computed)
    prompt_logprobs: int = -1
    frequency_penalty: float = 0.0  # minus penalty x count of the token in the output so far
    presence_penalty: float = 0.0  # minus penalty once a token occurs in the output
    repetition_penalty: float = 1.0  # tokens of prompt and output: logit / p if positive, x p if not
    logit_bias: dict[int, float] = {}  # added to the logits before sampling
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    grammar: GrammarSpec | None = None  # the output must match it; the request stops when it is complete
    thinking_budget: ThinkingBudget | None = None  # the reasoning is ended after this many tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """The sampler needs the request's tokens so far (ReqSlice.history): for its penalties, and
        to bring a grammar matcher up to date when it is not (worker_proc/grammar.py), and to see
        where a thinking budget stands."""
        return self.has_penalties or self.grammar is not None or self.thinking_budget is not None

    @property
    def processes_logits(self) -> bool:
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.thinking_budget is not None


# ---------------------------------------------------------------- tokenizer -> scheduler
class GenerateReq(msgspec.Struct, tag=True, kw_only=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    priority: int = 0  # larger = more important (used with --schedule-policy priority)
    # save the recurrent state after prompt[:-1] in the cache (a checkpoint), so that requests with
    # the same prompt arriving later (the other choices of n > 1) compute only its last token
    save_prompt_state: bool = False


class AbortReq(msgspec.Struct, tag=True, kw_only=True):
    rid: str
    reason: str = "client disconnected"


class FlushCacheReq(msgspec.Struct, tag=True, kw_only=True):
    req_id: int
    include_store: bool = False  # empty the state store too (POST /flush_cache?include_store=true)


class GetInfoReq(msgspec.Struct, tag=True, kw_only=True):
    req_id: int


ToScheduler = GenerateReq | AbortReq | FlushCacheReq | GetInfoReq


# ---------------------------------------------------------------- scheduler -> tokenizer
class TokenOut(msgspec.Struct, kw_only=True, array_like=True):
    """New tokens of one request since its previous TokenOut. Exactly one per request has
    `finished=True`; nothing follows it."""

    rid: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    matched_stop_token: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[float] | None = None
    error: str | None = None
    # with finish_reason "error": the request itself can never run on this server (it was rejected
    # before running; `error` names the limit) or its constraint left it no token to sample
    # (StepResult.grammar_rejected; `error` names the problem), so the client is told 400, not 503
    rejected: bool = False
    # with SamplingParams.top_logprobs: (token id, logprob) alternatives of each token of token_ids
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # with SamplingParams.prompt_logprobs, on the first TokenOut only: the logprob of prompt tokens
    # 1..prompt_len-1 (the first has none) and their alternatives
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_ranks: list[int] | None = None  # the rank of each of those prompt tokens (1 = the most likely)
    queue_s: float = -1.0  # on the first TokenOut with tokens: seconds the request waited for admission


class TokenOutBatch(msgspec.Struct, tag=True, kw_only=True):
    outs: list[TokenOut]


class FlushCacheResp(msgspec.Struct, tag=True, kw_only=True):
    req_id: int
    ok: bool
    message: str = ""


MetricName = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")]


class MetricRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One Prometheus sample for GET /metrics. Several records may share a name (a family) with
    different labels; a counter's name ends in `_total`. A histogram is one record per bucket (label
    `le`: the bucket's upper bound, "+Inf" last; value: the cumulative count) and one with label
    `le` = "sum" (the sum of the observations); like counters, they add up across replicas."""

    name: MetricName
    type: Literal["counter", "gauge", "histogram"]
    help: str
    labels: dict[str, str]
    value: int | float


class StoreStats(msgspec.Struct, kw_only=True):
    """Rank 0's state store counters since start (cumulative) and its size now."""

    entries_written: int = 0
    bytes_written: int = 0
    entries_read: int = 0
    bytes_read: int = 0
    write_drops: int = 0  # writes dropped: the writer's queue was full
    queued_bytes: int = 0  # bytes waiting in the writer's queue now (the scheduler polls while there are)
    write_errors: int = 0  # writes the store refused (unreachable, disk full)
    read_errors: int = 0  # entries that could not be read back (missing, damaged, store unreachable)
    write_seconds: list[float] = []  # each write's time (queue wait excluded) since the previous StepResult
    load_seconds: list[float] = []  # each load's time since the previous StepResult
    size_bytes: int = 0
    capacity_bytes: int = 0
    degraded: bool = False  # the store failed its last write: the server runs on memory alone until one works


class ServerState(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler's pools, queues, prefix-cache hits and policy state (slot counts are token
    slots for KV and state slots for Mamba; `*_evictable` is part of `*_cached`)."""

    kv_capacity: int = 0
    kv_free: int = 0
    kv_cached: int = 0
    kv_evictable: int = 0
    kv_used_by_requests: int = 0
    state_capacity: int = 0
    state_free: int = 0
    state_cached: int = 0
    state_evictable: int = 0
    state_used_by_requests: int = 0
    num_running: int = 0
    max_running_requests: int = 0
    num_waiting: int = 0
    num_cache_nodes: int = 0
    num_locked_nodes: int = 0
    prefix_queried_tokens: int = 0
    prefix_state_hit_tokens: int = 0
    prefix_kv_only_tokens: int = 0
    prefix_state_hit_rate: float = 0.0
    prefix_kv_match_rate: float = 0.0
    checkpoints_saved: int = 0
    checkpoints_skipped: int = 0
    retractions_kv: int = 0
    retractions_priority: int = 0
    batch_is_full: bool = False
    new_token_ratio: float = 0.0
    radix_cache: bool = True
    schedule_policy: str = ""
    context_length: int = 0
    state_store: StoreStats | None = None  # rank 0's state store (--state-cache-dir), None without one


class LoopInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where the scheduler loop's wall time goes per served step (means in ms): the workers' own
    step time, the round trip (batch sent -> StepResult received) and their difference, and the
    turnaround (StepResult received -> next batch sent)."""

    steps: int = 0
    worker_ms_mean: float = 0.0
    round_trip_ms_mean: float = 0.0
    outside_worker_ms_mean: float = 0.0
    turnaround_ms_mean: float = 0.0


class SchedulerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler's part of /get_server_info (as JSON, under "scheduler") and of /metrics
    (`metrics`). `in_flight_step`: the step of the batch the workers are running, -1 for none."""

    server: ServerState
    metrics: list[MetricRecord] = []
    in_flight_step: int = -1
    loop: LoopInfo = LoopInfo()


class InfoResp(msgspec.Struct, tag=True, kw_only=True):
    """Answer to GetInfoReq."""

    req_id: int
    info: SchedulerInfo


class SchedulerDead(msgspec.Struct, tag=True, kw_only=True):
    """Sent by the scheduler (or on its behalf by launch.py) when serving cannot continue."""

    reason: str


ToTokenizer = TokenOutBatch | FlushCacheResp | InfoResp | SchedulerDead


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


ToSchedulerFromWorker = WorkerReady | StepResult


# ---------------------------------------------------------------- children -> launch.py
class ProcReady(msgspec.Struct, tag=True, kw_only=True):
    name: str
    info: dict[str, int | float | str | bool] = {}


class ProcFailed(msgspec.Struct, tag=True, kw_only=True):
    name: str
    error: str


ToLauncher = ProcReady | ProcFailed
