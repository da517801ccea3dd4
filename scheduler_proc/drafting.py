"""Which running requests verify drafted tokens this round, and what they draft: prompt lookup over
the request's own tokens (`--speculative-algorithm NGRAM`) or the worker's MTP layers (`NEXTN`).

`NgramDrafter` (one per drafting request, kept across rounds) indexes the request's tokens as they
grow. A draft is what followed, earlier in the tokens, the longest suffix (between the min and max
match window) that occurs there, at most K tokens; among equally long matches the one followed by
the most tokens (up to K), then the most recent. `MtpDrafts` holds the guesses the worker's MTP layers
made in the step that produced the request's newest token (ReqSlice.draft_next asks for them; a guess
made before a later token is never used). Both decide when their request drafts (`Backoff`): after a
verify step that accepted nothing it sits out 1, 2, 4, ... (at most `MAX_BACKOFF`) rounds, and any
accepted draft ends the pause, so a request whose drafts miss costs a verify step only now and then.

`Speculation.attach` runs after admission (which comes first), on this round's decode slices, in
rounds whose batch size drafting was measured to pay at (`DraftingGain`): a request drafts only when
KV slots for its drafts and one state slot lent for the step's backup can be had, free or evicted
from the cache like any allocation (never taken from a running request); otherwise it decodes as
usual. Requests whose grammar waits for a reasoning end or with a thinking budget decode as usual.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from scheduler_proc.batch import BatchBuilder, SliceEntry
from scheduler_proc.request import Req
from scheduler_proc.resources import ReqResources
from shared.config import ServerArgs

logger = logging.getLogger(__name__)

RECENT = 32  # earlier occurrences of the last token that a lookup compares, newest first
MAX_BACKOFF = 16  # rounds a request sits out at most after verify steps that accepted nothing
EXPLORE_EVERY = 8  # rounds of a batch size between the first two that run the mode measured slower there
MAX_EXPLORE_EVERY = 128  # the interval doubles after each such round while the choice stands, up to this
SMOOTHING = 0.25  # weight of the newest round in a measured rate
MIN_ROUNDS = 3  # rounds of each mode a batch size is measured with before the rates decide
MARGIN = 0.05  # drafting stops where it is measured this much slower (step times are noisy)


class Backoff:
    """When one request drafts: it sits out rounds after verify steps that accepted nothing."""

    def __init__(self) -> None:
        self._pause = 0  # rounds left to sit out
        self._backoff = 1

    def ready(self) -> bool:
        """Whether the request drafts this round (False while it sits out after failed verifies)."""
        if self._pause > 0:
            self._pause -= 1
            return False
        return True

    def record(self, accepted: int) -> None:
        """A verify step of the request accepted `accepted` drafts."""
        if accepted:
            self._backoff = 1
            return
        self._pause = self._backoff
        self._backoff = min(MAX_BACKOFF, 2 * self._backoff)


class MtpDrafts(Backoff):
    """The worker's MTP guesses for one request, valid while its tokens are as they were made."""

    def __init__(self) -> None:
        super().__init__()
        self._made_at = -1  # len(tokens) when the guesses were made
        self._guesses: list[int] = []

    def keep(self, n_tokens: int, guesses: list[int]) -> None:
        self._made_at, self._guesses = n_tokens, list(guesses)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return self._guesses[:k] if self._made_at == len(tokens) and k > 0 else []


class NgramDrafter(Backoff):
    """Prompt lookup over one request's tokens (prompt then output; the list only grows)."""

    def __init__(self, min_window: int, max_window: int) -> None:
        super().__init__()
        self.min_window = min_window
        self.max_window = max_window
        self._positions: dict[int, list[int]] = {}  # token -> positions p < indexed holding it
        self._indexed = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """At most `k` tokens that followed the longest earlier match of the tokens' suffix."""
        for p in range(self._indexed, len(tokens) - 1):  # the last token has no continuation yet
            self._positions.setdefault(tokens[p], []).append(p)
        self._indexed = max(self._indexed, len(tokens) - 1)
        if k <= 0 or not tokens:
            return []
        end = len(tokens) - 1
        best, best_p = (0, 0), -1
        for p in reversed(self._positions.get(tokens[end], [])[-RECENT:]):
            m = 1
            while m < self.max_window and p - m >= 0 and tokens[p - m] == tokens[end - m]:
                m += 1
            key = (m, min(k, end - p))  # match length, then how much of a draft follows it
            if key > best:
                best, best_p = key, p
                if key == (self.max_window, k):
                    break
        if best[0] < self.min_window:
            return []
        return tokens[best_p + 1 : best_p + 1 + k]


@dataclass(frozen=True)
class SpeculationConfig:
    algorithm: str
    num_draft_tokens: int
    min_window: int
    max_window: int

    @classmethod
    def from_args(cls, args: ServerArgs) -> SpeculationConfig:
        return cls(args.speculative_algorithm, args.speculative_num_draft_tokens,
                   args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size)


class DraftingGain:
    """Whether drafting pays at a batch size, measured on this server's own steps. Per bucket of decode
    slices (1, 2-3, 4-7, ...): the output tokens per second of the worker's step time, as a moving
    average, of rounds that verified drafts and of rounds that did not. Drafting runs where it was
    not measured `MARGIN` slower; until each mode has `MIN_ROUNDS` rounds the less measured one runs,
    and after that a round now and then runs the other mode, so the choice follows the load: the
    `EXPLORE_EVERY`-th round of a bucket after its choice was made, then after twice as many rounds,
    and so on up to every `MAX_EXPLORE_EVERY`-th while the choice stands (a choice that changes starts
    over), so exploring a mode that keeps losing costs ever less. Only rounds of decode slices alone
    are measured (a prefill's time says nothing of drafting)."""

    def __init__(self) -> None:
        self.rate: dict[tuple[int, bool], float] = {}
        self.measured: dict[tuple[int, bool], int] = {}
        self.choice: dict[int, bool] = {}  # per bucket: whether drafting pays, as last decided
        self.interval: dict[int, int] = {}  # per bucket: rounds from one exploring round to the next
        self.since: dict[int, int] = {}  # per bucket: rounds since its last exploring round (or choice)

    @staticmethod
    def bucket(n_decode: int) -> int:
        return n_decode.bit_length()

    def wants(self, n_decode: int) -> bool:
        """Whether this round, with `n_decode` decode slices, drafts."""
        b = self.bucket(n_decode)
        n_drafted, n_plain = self.measured.get((b, True), 0), self.measured.get((b, False), 0)
        if min(n_drafted, n_plain) < MIN_ROUNDS:
            return n_drafted <= n_plain
        pays = self.rate[(b, True)] >= (1 - MARGIN) * self.rate[(b, False)]
        if self.choice.get(b) != pays:
            self.choice[b], self.interval[b], self.since[b] = pays, EXPLORE_EVERY, 0
        self.since[b] += 1
        if self.since[b] < self.interval[b]:
            return pays
        self.since[b] = 0
        self.interval[b] = min(MAX_EXPLORE_EVERY, 2 * self.interval[b])
        return not pays

    def observe(self, n_decode: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A round of `n_decode` decode slices alone emitted `tokens` in `seconds` of step time."""
        if seconds <= 0 or n_decode <= 0:
            return
        key, rate = (self.bucket(n_decode), drafted), tokens / seconds
        old = self.rate.get(key)
        self.rate[key] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
        self.measured[key] = self.measured.get(key, 0) + 1


def can_draft(r: Req) -> bool:
    """Requests whose sampling takes drafts: not those with a grammar that waits for a reasoning end or
    a thinking budget. A grammar from the first token is checked in the verify step
    (worker_proc/output/grammar.py: each position is masked as the grammar stands after the drafts before it,
    so a draft it refuses is never accepted); logprobs and top logprobs come for every token a verify
    step emits."""
    sp = r.sampling
    waits = sp.grammar is not None and bool(sp.grammar.after)
    return not (waits or sp.thinking_budget is not None)


class Speculation:
    """Attaches drafts to a round's decode slices and takes the verdict of each verify step."""

    def __init__(self, config: SpeculationConfig, res: ReqResources, context_length: int) -> None:
        self.config = config
        self.res = res
        self.context_length = context_length
        self.drafters: dict[str, NgramDrafter | MtpDrafts] = {}
        self.gain = DraftingGain()
        self._round = (0, False)  # (decode slices, drafted) of the batch last built

    @property
    def enabled(self) -> bool:
        return bool(self.config.algorithm)

    @property
    def runs_mtp(self) -> bool:
        """Whether the worker runs its MTP layers every step (each slice then says its next token)."""
        return self.config.algorithm == "NEXTN"

    def _drafter(self, rid: str) -> NgramDrafter | MtpDrafts:
        drafter = self.drafters.get(rid)
        if drafter is None:
            drafter = self.drafters[rid] = (MtpDrafts() if self.runs_mtp else
                                            NgramDrafter(self.config.min_window, self.config.max_window))
        return drafter

    def _room(self, r: Req) -> int:
        return min(r.max_new_tokens - r.num_output - 1, self.context_length - len(r.tokens) - 1)

    def attach(self, b: BatchBuilder) -> None:
        """Give this round's decode slices drafts where the request and the free resources allow; with
        MTP layers, ask the worker for the guesses that the next round's drafts will be."""
        if not self.enabled:
            return
        decode = [e for e in b.entries if not e.prefill and e.n == 1 and e.sample]
        self._round = (len(decode), False)
        if decode and self.gain.wants(len(decode)):
            for e in decode:
                if not can_draft(e.req):
                    continue
                r, room = e.req, self._room(e.req)
                drafter = self._drafter(r.rid)
                if room <= 0 or (not self.runs_mtp and not drafter.ready()):
                    continue
                drafts = drafter.propose(r.tokens, min(self.config.num_draft_tokens, room))
                if any(t < 0 for t in drafts):  # a lookup into an image's key tokens is no guess of a token
                    drafts = drafts[: next(i for i, t in enumerate(drafts) if t < 0)]
                if drafts and self.res.lend_for_drafts(r, len(drafts)):
                    e.drafts = drafts
                    self._round = (len(decode), True)
        if self.runs_mtp:
            for e in b.entries:
                if e.sample and can_draft(e.req) and self._room(e.req) > len(e.drafts) + 1 \
                        and self._drafter(e.req.rid).ready():  # fmt: skip
                    e.draft_next = self.config.num_draft_tokens

    def take_guesses(self, e: SliceEntry, guesses: dict[str, list[int]]) -> None:
        """`e`'s step ran and its tokens are in: keep the MTP guesses made after them."""
        drafter = self.drafters.get(e.req.rid)
        if e.draft_next and isinstance(drafter, MtpDrafts):
            drafter.keep(len(e.req.tokens), guesses.get(e.req.rid, []))

    def observe(self, entries: list[SliceEntry], refused: set[str], seconds: float) -> None:
        """The batch last built ran in `seconds` of step time (its entries settled; `refused` did not run)."""
        if not self.enabled or any(e.prefill for e in entries):
            return
        ran = [e for e in entries if e.req.rid not in refused]
        if ran:
            self.gain.observe(self._round[0], self._round[1], sum(e.n for e in ran if e.sample), seconds)

    def settle(self, e: SliceEntry, accepted: int) -> None:
        """The verify step of `e` ran and accepted `accepted` of its drafts."""
        self.res.settle_drafts(e.req, e, accepted)
        drafter = self.drafters.get(e.req.rid)
        if drafter is not None:
            drafter.record(accepted)

    def forget(self, rid: str) -> None:
        """The request left the table."""
        self.drafters.pop(rid, None)
