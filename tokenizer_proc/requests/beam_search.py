"""vLLM's beam search (`use_beam_search` on /v1/completions and /v1/chat/completions), driven from the
tokenizer process over ordinary one-token requests.

Owner: one `BeamSearch` per prompt of a request, held by its handler (`search`); it owns that prompt's
live and finished beams and the step requests in flight. Rules (vLLM's serving entrypoint):
- the beam width is `n`; the answer is the `n` best beams, best first;
- each step sends, for every live beam, one greedy request over the prompt and the beam's tokens for
  one token and its 2 x width most likely next tokens (`step_sampling`). It goes through `generate`
  like any request, so the scheduler admits it, or keeps it waiting for a state slot, as any other;
- the candidates of a step are every live beam extended by one of its tokens, scored by cumulative
  logprob: the model's raw log-softmax, which temperature does not change (as vLLM's logprobs);
- a candidate whose token is an EOS (unless ignore_eos) or a stop_token_id, or whose text holds a stop
  string, is finished with "stop"; its cumulative logprob includes that token's, its tokens do not
  hold an EOS / stop token. The `width` best other candidates are the next live beams (ties: the
  earlier beam, then the more likely token); after max_tokens steps the live beams end with "length";
- a finished beam scores cum_logprob / L ** length_penalty, L = prompt + output tokens (vLLM's
  get_beam_search_score, the EOS not counted);
- the search stops early only when no live beam, nor any beam grown from one, can score above the
  width-th best finished beam (`_bound`): stopping never changes the answer;
- every step's request extends the tokens its parent's request ran, so the radix cache resumes it from
  that request's state (a copy-on-write fork) and it computes one token;
- a step's first failed finish ends the search with its error; cancelling the search (the client left)
  closes the step's requests, and `generate` aborts each one that had not finished.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncGenerator, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from shared.messages import SamplingParams
from tokenizer_proc.http.errors import ApiError, bad_request, unavailable
from tokenizer_proc.requests.flow import Accumulated, Serving, collect_all, finish_error
from tokenizer_proc.requests.generation import BackendUnavailable, Finish, Piece, Reservation, generate, precheck
from tokenizer_proc.requests.prepare import PreparedRequest
from tokenizer_proc.requests.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Beam:
    """One hypothesis: its output tokens, their logprobs, and the cumulative logprob (with the logprob of
    a finishing EOS / stop token, which `tokens` does not hold)."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)  # each token's step candidates
    cum: float = 0.0
    finish: Finish | None = None
    text: str = ""


@dataclass(frozen=True)
class BeamParams:
    """What one prompt's search needs: width, max_tokens, length penalty, what finishes a beam."""

    width: int
    max_tokens: int
    length_penalty: float
    prompt_len: int
    stop_ids: frozenset[int]
    stops: tuple[str, ...] = ()
    skip_special_tokens: bool = True


def score(beam: Beam, p: BeamParams) -> float:
    """vLLM's length-penalised score: cum_logprob / (prompt + output tokens) ** length_penalty."""
    return beam.cum / float(p.prompt_len + len(beam.tokens)) ** p.length_penalty


def _bound(beam: Beam, p: BeamParams) -> float:
    """The highest score any beam grown from the live `beam` can reach: its cumulative logprob only
    falls (it is <= 0), so with length_penalty > 0 at most cum / (the longest L) ** penalty, else at
    most its own score now. A cumulative logprob above 0 (rounding) bounds nothing."""
    if beam.cum > 0:
        return math.inf
    if p.length_penalty > 0:
        return beam.cum / float(p.prompt_len + p.max_tokens) ** p.length_penalty
    return score(beam, p)


class BeamSearch:
    """The beams of one prompt (module rules). `step_inputs` gives each live beam's output so far;
    `advance` takes each one's (token, logprob) candidates; `done` / `best` give the answer."""

    def __init__(self, params: BeamParams, tok: TextTokenizer):
        self.p, self.tok = params, tok
        self.live: list[Beam] = [Beam([])]
        self.finished: list[Beam] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        if not self.live or self.steps >= self.p.max_tokens:
            return True
        if len(self.finished) < self.p.width:
            return False
        floor = sorted((score(b, self.p) for b in self.finished), reverse=True)[self.p.width - 1]
        return all(_bound(b, self.p) < floor for b in self.live)

    def advance(self, candidates: Sequence[Sequence[tuple[int, float]]]) -> None:
        """One step: `candidates[i]` are the live beam i's next tokens, most likely first."""
        grown: list[Beam] = []
        for beam, cands in zip(self.live, candidates, strict=True):
            for token, lp in cands[: 2 * self.p.width]:
                child = Beam(beam.tokens + [token], beam.logprobs + [lp], beam.tops + [list(cands)], beam.cum + lp)
                if token in self.p.stop_ids:
                    child.tokens, child.logprobs, child.tops = beam.tokens, beam.logprobs, beam.tops
                    child.finish = Finish("stop", matched=token)
                    self.finished.append(child)
                elif self._stopped(child):
                    self.finished.append(child)
                else:
                    grown.append(child)
        grown.sort(key=lambda b: -b.cum)  # stable: the earlier beam, then the more likely token
        self.live = grown[: self.p.width]
        self.steps += 1
        if self.steps >= self.p.max_tokens:
            for beam in self.live:
                beam.finish = Finish("length")
            self.finished.extend(self.live)
            self.live = []

    def _stopped(self, beam: Beam) -> bool:
        """Whether the beam's text holds a stop string (then its text is cut before it)."""
        if not self.p.stops:
            return False
        detok = self.tok.detokenizer(self.p.stops, self.p.skip_special_tokens)
        text = detok.push(beam.tokens)
        if detok.matched_stop is None:
            return False
        beam.text, beam.finish = text, Finish("stop", matched=detok.matched_stop)
        return True

    def best(self) -> list[Beam]:
        """The `width` best beams, best first, each with its text."""
        pool = self.finished + self.live
        ranked = sorted(pool, key=lambda b: -score(b, self.p))[: self.p.width]
        for beam in ranked:
            if beam.finish is None or beam.finish.reason != "stop" or not isinstance(beam.finish.matched, str):
                beam.text = self.tok.decode(beam.tokens, self.p.skip_special_tokens)
        return ranked


# the request fields a beam search computes nothing from: each a 400 unless neutral
_NEUTRAL_SAMPLING = (
    ("top_p", lambda s: s.top_p == 1.0), ("top_k", lambda s: s.top_k in (-1, 0)), ("min_p", lambda s: s.min_p == 0),
    ("frequency_penalty", lambda s: s.frequency_penalty == 0), ("presence_penalty", lambda s: s.presence_penalty == 0),
    ("repetition_penalty", lambda s: s.repetition_penalty == 1), ("logit_bias", lambda s: not s.logit_bias),
    ("min_tokens", lambda s: s.min_tokens == 0), ("prompt_logprobs", lambda s: s.prompt_logprobs < 0),
    ("response_format", lambda s: s.grammar is None), ("thinking_token_budget", lambda s: s.thinking_budget is None),
)  # fmt: skip


def check_prepared(req: PreparedRequest) -> None:
    """400 naming the first field of a prepared beam-search request that beam search does not apply."""
    for name, neutral in _NEUTRAL_SAMPLING:
        if not neutral(req.sampling):
            what = "a structured output (response_format, structured_outputs, regex, ebnf, tool_choice)" \
                if name == "response_format" else name
            raise bad_request(f"use_beam_search does not combine with {what}", name)
    if req.stop_regexes:
        raise bad_request("use_beam_search does not combine with stop_regex", "stop_regex")
    if req.sampling.max_new_tokens < 1:
        raise bad_request("use_beam_search needs max_tokens >= 1", "max_tokens")


def step_sampling(req: PreparedRequest, width: int) -> SamplingParams:
    """The sampling of one step's request: greedy, one token, the 2 x width most likely alternatives
    (more when the client asked for more top logprobs)."""
    return SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True,
                          top_logprobs=max(2 * width, req.sampling.top_logprobs))  # fmt: skip


def beam_params(req: PreparedRequest, tok: TextTokenizer, width: int, length_penalty: float) -> BeamParams:
    eos = frozenset() if req.sampling.ignore_eos else frozenset(tok.eos_token_ids)
    return BeamParams(width, req.sampling.max_new_tokens, length_penalty, len(req.input_ids),
                      eos | frozenset(req.sampling.stop_token_ids), req.stops, req.skip_special_tokens)  # fmt: skip


async def _step(ctx: Serving, req: PreparedRequest, state: BeamSearch, sampling: SamplingParams) -> list[Accumulated]:
    """Run one step's requests (one per live beam) together: their outputs, or the first failure's ApiError."""
    iters = []
    for i, beam in enumerate(state.live):
        sub = replace(req, rid=f"{req.rid}-beam{state.steps}.{i}", input_ids=req.input_ids + beam.tokens,
                      sampling=sampling, stops=(), stream=False, save_prompt_state=False)  # fmt: skip
        # the search's own reservations count it in the admission; a step's rid is derived from a held one
        iters.append(generate(ctx.backend, ctx.tok, sub, ctx.in_flight, Reservation(sub.rid), ctx.matching))
    accs = await collect_all(iters)
    for acc in accs:
        err = finish_error(acc.last.finish if acc.last else None, abort_is_error=True)
        if err is not None:
            raise err
        if not acc.top_logprobs:
            raise ApiError(503, "a beam search step returned no candidates")
    return accs


async def search(ctx: Serving, req: PreparedRequest, width: int, length_penalty: float) -> tuple[list[Beam], int]:
    """Beam search over `req`'s prompt (module rules): (the `width` best beams, best first; the prompt tokens
    the first step found cached). Raises the ApiError of a failed step; cancelling it aborts the step's
    requests."""
    state = BeamSearch(beam_params(req, ctx.tok, width, length_penalty), ctx.tok)
    sampling = step_sampling(req, width)
    cached, computed, sent = 0, 0, 0
    while not state.done:
        accs = await _step(ctx, req, state, sampling)
        lasts = [a.last for a in accs if a.last is not None]
        if state.steps == 0:
            cached = lasts[0].cached_tokens
        sent += len(accs)
        computed += sum(p.prompt_tokens - p.cached_tokens for p in lasts)
        state.advance([a.top_logprobs[0] for a in accs])
    logger.debug("beam search %s: %d steps, %d requests, %d tokens computed", req.rid, state.steps, sent, computed)
    return state.best(), cached


def as_accumulated(beam: Beam, req: PreparedRequest, cached: int) -> Accumulated:
    """One returned beam as the choice output the OpenAI formats take."""
    acc = Accumulated(text=[beam.text], ids=list(beam.tokens))
    if req.return_logprobs:
        acc.logprobs = list(beam.logprobs)
        acc.top_logprobs = [t[: req.sampling.top_logprobs] for t in beam.tops]
    acc.last = Piece("", [], None, len(req.input_ids), len(beam.tokens), cached, beam.finish or Finish("length"))
    return acc


async def _all(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Every coroutine's result; the first exception cancels the rest (and so aborts their requests)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def admit(ctx: Serving, reqs: Sequence[PreparedRequest]) -> list[Reservation]:
    """Admission as flow.respond's, before the response starts: the field checks, the KV-fit check, the queue
    limit for `reqs` (the search counts as its `width` choices per prompt, whose rids it reserves until it
    ends: the caller releases the returned holds), the backend's health."""
    check_prepared(reqs[0])
    await ctx.admission.check_fits(ctx.backend, reqs)
    await ctx.in_flight.settle([r.rid for r in reqs])
    ctx.admission.admit(len(ctx.in_flight), len(reqs))
    holds: list[Reservation] = []
    try:
        for r in reqs:
            holds.append(precheck(ctx.backend, r, ctx.in_flight))
    except BackendUnavailable as e:
        release(ctx, holds)
        raise unavailable(str(e)) from e
    except ApiError:
        release(ctx, holds)
        raise
    return holds


def release(ctx: Serving, holds: Sequence[Reservation]) -> None:
    for h in holds:
        ctx.in_flight.release(h)


async def run(ctx: Serving, reqs: Sequence[PreparedRequest], width: int,
              length_penalty: float) -> list[tuple[int, Accumulated]]:  # fmt: skip
    """Beam-search every prompt of `reqs` (`width` prepared choices per prompt, in order): (position in `reqs`,
    output) of each answered choice, best beam first per prompt. A failed step raises its ApiError (503 when
    the scheduler is gone)."""
    firsts = list(reqs[::width])
    try:
        results = await _all([search(ctx, r, width, length_penalty) for r in firsts])
    except BackendUnavailable as e:
        raise unavailable(str(e)) from e
    out = []
    for pi, (beams, cached) in enumerate(results):
        for rank, beam in enumerate(beams):
            pos = pi * width + rank
            out.append((pos, as_accumulated(beam, reqs[pos], cached)))
    return out


async def streamed(ctx: Serving, reqs: Sequence[PreparedRequest], width: int,
                   length_penalty: float) -> AsyncGenerator[tuple[int, Piece], None]:  # fmt: skip
    """The search's answer as a stream, as vLLM streams it: nothing until the search ends, then each returned
    beam whole, as one piece of its choice."""
    for pos, acc in await run(ctx, reqs, width, length_penalty):
        last = acc.last
        assert last is not None
        yield pos, Piece("".join(acc.text), acc.ids, acc.logprobs or None, last.prompt_tokens,
                         last.completion_tokens, last.cached_tokens, last.finish, acc.top_logprobs or None)  # fmt: skip
