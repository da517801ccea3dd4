"""What a worker's StepResult does to the requests of the batch it answers (docs/architecture.md,
"Request lifecycle", step 7).

Owner: `Scheduler.apply_result` checks that the reply is for the batch in flight, takes that batch
out of flight, keeps rank 0's store counters and hands the rest to `apply_step`. This module decides,
per reply:
- the state store's loads the step settled (`settle_loads`): a loaded prefix joins the tree, a failed
  one will be computed; the request waits again, or ends when it was aborted meanwhile;
- a failed step (`StepResult.error`) ends every request it carried with an error (`fail_step`);
- per slice: a refused copy-on-write rolls the slice back exactly like an admission refusal; else the
  accepted drafts are settled, the computed positions advance, prompt logprobs are kept, a finished
  prompt is shared through the tree, the counters count, and the sampled tokens become a TokenOut or
  the request's finish (stop, length, error, abort: `_emit`).

Rules: a request changes status only through the scheduler's doors (`transition`, `finish`), which it
reaches through `ResultTarget`, the part of a scheduler applying a result may touch; never while a
slice of it is in flight (the batch is out of flight before `apply_step` runs).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from scheduler_proc.admission import Admission
from scheduler_proc.batch import InFlight, SliceEntry
from scheduler_proc.drafting import Speculation
from scheduler_proc.metrics import SchedulerMetrics
from scheduler_proc.request import Req, ReqStatus, token_out
from scheduler_proc.resources import ReqResources
from shared.messages import FinishReason, StepResult, TokenOut

logger = logging.getLogger(__name__)


class ResultTarget(Protocol):
    """What applying a result touches of a scheduler (the Scheduler satisfies it): its resources,
    counters, speculation and admission (for a worker's refusal), the requests whose stored prefix
    loads, the model's EOS ids, and the two doors by which a request changes status."""

    @property
    def res(self) -> ReqResources: ...
    @property
    def metrics(self) -> SchedulerMetrics: ...
    @property
    def speculation(self) -> Speculation: ...
    @property
    def admission(self) -> Admission: ...
    @property
    def loading(self) -> Mapping[str, Req]: ...
    @property
    def eos_ids(self) -> frozenset[int]: ...
    def transition(self, r: Req, to: ReqStatus, donate: bool = False, keep: bool = False) -> None: ...
    def finish(self, r: Req, reason: FinishReason, new: list[int] | None = None, matched: int | None = None,
               logprobs: list[float] | None = None, error: str | None = None,
               top: list[list[tuple[int, float]]] | None = None, rejected: bool = False) -> TokenOut: ...  # fmt: skip


def apply_step(s: ResultTarget, fl: InFlight, result: StepResult) -> list[TokenOut]:
    """Apply `result`, the reply to `fl` (already out of flight); the TokenOuts it produces."""
    if result.store is not None:
        for seconds in result.store.load_seconds:
            s.metrics.observe("hyssm_state_store_load_seconds", seconds)
        for seconds in result.store.write_seconds:
            s.metrics.observe("hyssm_state_store_write_seconds", seconds)
    s.metrics.inc("hyssm_image_encodings_total", result.images_encoded, result="encoded")
    s.metrics.inc("hyssm_image_encodings_total", result.images_cached, result="cached")
    outs = settle_loads(s, set(result.store_done), set(result.store_failed), bool(result.error))
    if result.error:
        return outs + fail_step(s, fl, f"worker step {result.step} failed: {result.error}")
    refused = set(result.refused)
    for e in fl.entries:
        r = e.req
        if r.rid in refused:
            _on_refused(s, e)
            if r.abort_reason is not None:
                outs.append(s.finish(r, "abort"))
            continue
        if e.drafts:
            _settle_drafts(s, e, result)
        s.res.after_step(r, e, fl.step)
        if r.rid in result.prompt_logprobs:
            _keep_prompt_logprobs(r, e, result)
        if e.prefill and e.sample:
            s.res.cache_prompt(r)
        _account_step(s.metrics, e)
        out = _emit(s, r, e, result)
        if out is not None:
            outs.append(out)
        if r.status != ReqStatus.FINISHED:  # the next round's drafts, while it runs
            s.speculation.take_guesses(e, result.drafts)
    s.speculation.observe(fl.entries, refused, result.elapsed_s)
    return outs


def settle_loads(s: ResultTarget, done: set[int], failed: set[int], step_failed: bool) -> list[TokenOut]:
    """The loads from the state store the step settled (all of them when it failed: the workers
    drop theirs): each prefix joins the tree or (failed) is computed; the request waits again (its
    stored prefix is looked up once per wait), or ends if it was aborted meanwhile."""
    outs: list[TokenOut] = []
    for r in list(s.loading.values()):
        ticket = r.load
        assert ticket is not None
        if not step_failed and ticket.load_id not in done and ticket.load_id not in failed:
            continue
        ok = not step_failed and ticket.load_id in done
        s.res.finish_load(r, ticket, ok)
        r.load = None
        s.metrics.inc("hyssm_state_store_loads_total", result="loaded" if ok else "failed")
        if ok:
            s.metrics.inc("hyssm_state_store_loaded_tokens_total", ticket.end - ticket.start)
            r.loaded_tokens += ticket.end - ticket.start
        if r.abort_reason is not None:
            outs.append(s.finish(r, "abort"))
        else:
            s.transition(r, ReqStatus.WAITING)
    return outs


def fail_step(s: ResultTarget, fl: InFlight, reason: str) -> list[TokenOut]:
    """The step failed on the workers, so every slot it wrote may hold garbage: its requests end
    with an error (nothing donated: their own slots are freed) and the checkpoints it was to fill
    leave the tree. Nothing else was written; waiting requests and the rest of the cache go on."""
    logger.error("%s; failing its %d requests", reason, len(fl.entries))
    outs = [s.finish(e.req, "error", error=reason) for e in fl.entries]
    s.res.drop_checkpoints(fl.ckpt_nodes)
    return outs


def _settle_drafts(s: ResultTarget, e: SliceEntry, result: StepResult) -> None:
    """A verify slice: the slots of the drafts the worker rejected go back (ReqResources.settle_drafts)
    and only the accepted ones stay in `e.drafts`, to be output."""
    accepted = result.accepted.get(e.req.rid, 0)
    if not 0 <= accepted <= len(e.drafts):
        raise ValueError(f"StepResult accepts {accepted} of {len(e.drafts)} drafts of {e.req.rid}")
    s.speculation.settle(e, accepted)
    m = s.metrics
    m.inc("hyssm_spec_verify_steps_total")
    m.inc("hyssm_spec_draft_tokens_total", len(e.drafts))
    m.inc("hyssm_spec_accepted_tokens_total", accepted)
    e.drafts = e.drafts[:accepted]


def _on_refused(s: ResultTarget, e: SliceEntry) -> None:
    """A worker refused the slice's copy-on-write: roll back exactly like NO_TOKEN."""
    r = e.req
    s.res.undo_slice(r, e)
    s.admission.record_refusal(r, "worker_refusal")
    if e.admitted:
        s.transition(r, ReqStatus.WAITING)


def _account_step(m: SchedulerMetrics, e: SliceEntry) -> None:
    """Count the slice's prefill tokens and, for an admission, what it found in the caches."""
    r = e.req
    if e.prefill:
        m.inc("hyssm_prefill_tokens_total", e.n)
    if not e.admitted:
        return
    m.inc("hyssm_admitted_requests_total")
    if r.retracted_at >= 0:
        m.inc("hyssm_retract_recomputed_tokens_total", max(0, r.retracted_at - e.start))
        r.retracted_at = -1
    if not r.admitted:
        r.admitted = True
        r.cached_tokens = e.start
        peek = r.peek
        kv_len = peek.kv_len if peek is not None else e.start
        m.inc("hyssm_prefix_cache_queried_tokens_total", len(r.tokens))
        m.inc("hyssm_prefix_cache_hit_tokens_total", e.start, kind="state")
        m.inc("hyssm_prefix_cache_hit_tokens_total", max(0, kv_len - e.start), kind="kv_only")
        from_store = min(r.loaded_tokens, e.start)
        if e.start:
            m.inc("hyssm_cache_hits_total", tier="store" if from_store else "memory")
        m.inc("hyssm_cache_hit_tokens_total", from_store, tier="store")
        m.inc("hyssm_cache_hit_tokens_total", e.start - from_store, tier="memory")


def _emit(s: ResultTarget, r: Req, e: SliceEntry, result: StepResult) -> TokenOut | None:
    """The slice's TokenOut: its new tokens, or the request's finish (an abort that waited for the
    step, a missing token, a grammar's end or error, EOS or a stop id, the length)."""
    if r.abort_reason is not None:
        return s.finish(r, "abort")
    if not e.sample:
        return None
    tok = result.next_tokens.get(r.rid)
    if tok is None:
        return s.finish(r, "error", error=f"worker returned no token for step {result.step}")
    if r.rid in result.grammar_rejected:  # no token could follow under the constraint: nothing more is output
        return s.finish(r, "error", error=result.grammar_errors.get(r.rid), rejected=True)
    new = [*e.drafts, tok]  # the accepted drafts (never a stop token: the worker ends the run there)
    r.tokens.extend(new)
    s.metrics.inc("hyssm_generated_tokens_total", len(new))
    sp = r.sampling
    logprobs = result.logprobs.get(r.rid) if sp.logprobs else None
    top = result.top_logprobs.get(r.rid) if sp.top_logprobs else None
    if any(x is not None and len(x) != len(new) for x in (logprobs, top)):
        return s.finish(r, "error", error=f"worker returned logprobs for other than the {len(new)} tokens "
                        f"of step {result.step}")
    if (error := result.grammar_errors.get(r.rid)) is not None:
        return s.finish(r, "error", new, logprobs=logprobs, error=error, top=top)
    if (not sp.ignore_eos and tok in s.eos_ids) or tok in sp.stop_token_ids or r.rid in result.grammar_done:
        return s.finish(r, "stop", new, matched=tok, logprobs=logprobs, top=top)
    if r.num_output >= sp.max_new_tokens:
        return s.finish(r, "length", new, logprobs=logprobs, top=top)
    return token_out(r, new, None, logprobs=logprobs, top=top)


def _keep_prompt_logprobs(r: Req, e: SliceEntry, result: StepResult) -> None:
    """Entries [e.start, ...) of the request's prompt logprobs, from its slice's result (a
    recomputed position replaces what an earlier run of it gave)."""
    want = max(0, r.prompt_len - 1 - e.start)
    del r.prompt_lps[e.start :]
    r.prompt_lps.extend(result.prompt_logprobs[r.rid][:want])
    del r.prompt_ranks[e.start :]
    r.prompt_ranks.extend(result.prompt_ranks.get(r.rid, [])[:want])
    if r.sampling.prompt_logprobs > 0:
        del r.prompt_tops[e.start :]
        r.prompt_tops.extend(result.prompt_top_logprobs.get(r.rid, [])[:want])
