"""Structured output on worker rank 0: grammar compilation, token masks, matcher state (xgrammar).

Who holds what: the tokenizer process validates a request's `GrammarSpec` (tokenizer_proc/requests/
structured.py) before it is queued; rank 0, which samples, holds the compiled grammars (one
compilation per distinct spec, kept in an LRU) and one matcher per constrained request, keyed by rid.
Each step, before sampling, every constrained row's logits get its matcher's token mask (tokens that
cannot continue the grammar are -inf; after the grammar is complete only the stop tokens remain);
after sampling, the matcher accepts the chosen token. A matcher whose grammar is then terminated is
reported in `StepResult.grammar_done` (the scheduler finishes the request with "stop") and dropped.
A token the matcher refuses ends the request with an error (`StepResult.grammar_errors`). When the
constraint itself left the request no token to sample (its mask allowed none, or only stop tokens
while min_tokens blocks them: a language emptied only after some output, or min_tokens beyond what
it allows) it is the client's fault, named in `StepResult.grammar_rejected` (a 400); a refused token
the mask allowed is an internal failure (a 503). The diagnosis runs only on a refusal.

Sync rule: a matcher is valid for (rid, spec) after exactly `output_len` accepted tokens. A slice
whose matcher is missing (evicted, a new request reusing the rid, a step that failed) or out of step
gets a fresh one that replays the request's output tokens from `ReqSlice.history`; so the state is
a function of the tokens the scheduler holds, whatever happened to earlier steps. A spec with `after`
(a reasoning model's `</think>`) constrains only what follows the first occurrence of those tokens in
the output: until then its row is not masked and it has no matcher.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shared.messages import GrammarSpec
from worker_proc.output.sampling import SampleRequest

logger = logging.getLogger(__name__)

MAX_COMPILED = 256
MAX_MATCHERS = 8192


def vocab_of(model_dir: str, vocab_size: int) -> tuple[list[str], str, bool]:
    """(token string of every id up to `vocab_size`, xgrammar vocab type name, add_prefix_space)
    from the model's tokenizer.json: ByteLevel decoders are BYTE_LEVEL, ByteFallback ones
    BYTE_FALLBACK, anything else RAW."""
    from tokenizers import Tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    encoded = [""] * vocab_size
    for text, idx in tok.get_vocab(with_added_tokens=True).items():
        if 0 <= idx < vocab_size:
            encoded[idx] = text
    with open(path, encoding="utf-8") as f:
        decoder = json.load(f).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {p.get("type") for p in parts if isinstance(p, dict)}
    if "ByteLevel" in kinds:
        return encoded, "BYTE_LEVEL", False
    if "ByteFallback" in kinds:
        return encoded, "BYTE_FALLBACK", "Metaspace" in kinds or "Strip" in kinds
    return encoded, "RAW", False


def _tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


@dataclass
class _Matcher:
    spec: GrammarSpec
    matcher: Any
    accepted: int


class GrammarRuntime:
    """Rank 0's compiled grammars and matchers (module doc). xgrammar is imported on first use."""

    def __init__(self, model_dir: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.model_dir, self.vocab_size, self.eos_ids = model_dir, vocab_size, tuple(eos_ids)
        self._xgr: Any = None
        self._compiler: Any = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._matchers: OrderedDict[str, _Matcher] = OrderedDict()

    def _setup(self) -> None:
        import xgrammar

        encoded, kind, prefix_space = vocab_of(self.model_dir, self.vocab_size)
        info = xgrammar.TokenizerInfo(encoded, getattr(xgrammar.VocabType, kind), vocab_size=self.vocab_size,
                                      stop_token_ids=list(self.eos_ids) or None, add_prefix_space=prefix_space)
        self._xgr, self._compiler = xgrammar, xgrammar.GrammarCompiler(info, max_threads=1)

    def compiled(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (compiled once while it stays among the MAX_COMPILED most
        recently used)."""
        if self._compiler is None:
            self._setup()
        if (hit := self._compiled.get(spec)) is not None:
            self._compiled.move_to_end(spec)
            return hit
        c = self._compiler
        if spec.kind in ("json_schema", "json_object"):  # compact JSON (tokenizer_proc/requests/structured.py)
            out = c.compile_json_schema(spec.source, strict_mode=spec.strict, any_whitespace=False)
        elif spec.kind == "regex":
            out = c.compile_regex(spec.source)
        else:
            out = c.compile_grammar(spec.source)
        self._compiled[spec] = out
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return out

    def _stops(self, r: SampleRequest) -> list[int]:
        p = r.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
        return sorted(t for t in stops if 0 <= t < self.vocab_size) or list(self.eos_ids)

    @staticmethod
    def _start(r: SampleRequest) -> int | None:
        """The output index from which the grammar constrains (None: not yet, `after` not in the output)."""
        spec = r.params.grammar
        assert spec is not None
        if not spec.after:
            return 0
        hist = list(r.history or [])
        out = hist[len(hist) - r.output_len:] if r.output_len else []
        n = len(spec.after)
        return next((i + n for i in range(len(out) - n + 1) if tuple(out[i:i + n]) == spec.after), None)

    def _matcher(self, r: SampleRequest) -> _Matcher | None:
        """`r`'s matcher, up to date with its output (None while its grammar waits for `after`)."""
        spec = r.params.grammar
        assert spec is not None
        m = self._matchers.get(r.rid)
        if m is None or m.spec != spec or m.accepted != r.output_len:
            start = self._start(r)
            if start is None:
                return None
            matcher = self._xgr_matcher(spec, r)
            hist = list(r.history or [])
            for tok in hist[len(hist) - r.output_len + start:] if r.output_len > start else []:
                if not matcher.accept_token(tok):
                    raise ValueError(f"output token {tok} does not match the grammar")
            m = self._matchers[r.rid] = _Matcher(spec, matcher, r.output_len)
            if len(self._matchers) > MAX_MATCHERS:
                self._matchers.popitem(last=False)
        self._matchers.move_to_end(r.rid)
        return m

    def _xgr_matcher(self, spec: GrammarSpec, r: SampleRequest) -> Any:
        compiled = self.compiled(spec)
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=self._stops(r))

    def constrain(self, reqs: Sequence[SampleRequest], errors: dict[str, str]) -> Callable[[torch.Tensor], None] | None:
        """A function that masks the constrained rows of the logits sampling chooses from (None when
        no row is constrained). A request whose matcher cannot be brought up to date is put in
        `errors` and left unconstrained (the scheduler ends it with that error). Consecutive requests
        of one rid are a verify slice's positions, the later ones with a draft more in their history:
        position k is masked as the grammar stands after the first k drafts, which the matcher accepts
        for the masking and then rolls back; positions after a draft the grammar refuses stay free
        (that draft is never accepted, since the draw before it is masked, so they are never used)."""
        rows: list[int] = []
        groups: list[tuple[_Matcher, list[int]]] = []  # matcher, its drafts (one per later position)
        i = 0
        while i < len(reqs):
            n = next((k for k in range(i + 1, len(reqs)) if reqs[k].rid != reqs[i].rid), len(reqs)) - i
            r = reqs[i]
            if r.params.grammar is not None:
                try:
                    m = self._matcher(r)
                    if m is not None:
                        groups.append((m, [(reqs[i + k].history or [0])[-1] for k in range(1, n)]))
                        rows.extend(range(i, i + n))
                except (ValueError, RuntimeError) as e:
                    errors[r.rid] = f"structured output failed: {e}"
            i += n
        if not rows:
            return None
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)  # all tokens allowed
        j = 0
        for m, drafts in groups:
            m.matcher.fill_next_token_bitmask(bitmask, j)
            tried = 0
            for k, tok in enumerate(drafts, start=1):
                if not m.matcher.accept_token(tok):
                    break
                tried += 1
                if m.matcher.is_terminated():  # a drafted stop: nothing follows it
                    break
                m.matcher.fill_next_token_bitmask(bitmask, j + k)
            if tried:
                m.matcher.rollback(tried)
            j += len(drafts) + 1

        def apply(logits: torch.Tensor) -> None:
            sub = logits[rows]
            self._xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device))
            logits[rows] = sub

        return apply

    def forget(self, rids: Sequence[str]) -> None:
        """Drop the matchers of requests that ended (ForwardBatch.ended)."""
        for rid in rids:
            self._matchers.pop(rid, None)

    def accept(self, reqs: Sequence[SampleRequest], tokens: Sequence[int], errors: dict[str, str],
               rejected: set[str]) -> list[str]:
        """Advance every constrained request's matcher by its emitted tokens (a verify slice's in order,
        one entry each); the rids whose grammar is now terminated (their matchers are dropped). A token
        the matcher refuses puts the rid in `errors`, and in `rejected` too when the constraint itself
        left the request no token to sample (`dead_end`: the client's fault, not the server's); so does
        a stop token that min_tokens masked, which is drawn only from a row that allowed nothing (a model
        whose stop token is id 0: argmax over a row of -inf)."""
        done = []
        for r, tok in zip(reqs, tokens, strict=True):
            if r.params.grammar is None or r.rid in errors:
                continue
            m = self._matchers.get(r.rid)
            if m is None and self._start(r) is None:
                continue  # the grammar waits for `after` (which this token may complete)
            if m is None or not m.matcher.accept_token(tok):
                if m is not None and (problem := self.dead_end(r, m.matcher)) is not None:
                    errors[r.rid] = problem
                    rejected.add(r.rid)
                else:
                    errors[r.rid] = f"structured output failed: sampled token {tok} does not match the grammar"
                self._matchers.pop(r.rid, None)
                continue
            m.accepted += 1
            if m.matcher.is_terminated():
                del self._matchers[r.rid]
                if tok in self._min_tokens_blocked(r):  # a stop min_tokens masked: the row had no token left
                    errors[r.rid] = self._min_tokens_problem(r)
                    rejected.add(r.rid)
                else:
                    done.append(r.rid)
        return done

    def dead_end(self, r: SampleRequest, matcher: Any) -> str | None:
        """Why `r` had no token it may sample where `matcher` stands (None: its mask allowed some, so a
        refused token there is an internal failure). Either the constraint allows no token at all, or
        only the stop tokens, which min_tokens still blocks. Only called after a refused token (the
        matcher has not moved), so the hot path pays nothing."""
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        shifts = torch.arange(32, dtype=bitmask.dtype)
        allowed = ((bitmask[0, :, None] >> shifts) & 1).flatten()[: self.vocab_size].bool()
        if not bool(allowed.any()):
            return (f"structured output: no token can continue the output under the constraint after "
                    f"{_tokens(r.output_len)} (no text satisfies it)")
        blocked = [t for t in self._min_tokens_blocked(r) if 0 <= t < self.vocab_size]
        if blocked and int(allowed.sum()) == int(allowed[blocked].sum()):
            return self._min_tokens_problem(r)
        return None

    @staticmethod
    def _min_tokens_problem(r: SampleRequest) -> str:
        n = r.output_len
        return f"min_tokens {r.params.min_tokens} cannot be met: the constraint is complete after {_tokens(n)}"

    def _min_tokens_blocked(self, r: SampleRequest) -> set[int]:
        """The stop tokens min_tokens masks for `r` at its position (worker_proc/output/logit_processing.py)."""
        p = r.params
        if r.output_len >= p.min_tokens:
            return set()
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
