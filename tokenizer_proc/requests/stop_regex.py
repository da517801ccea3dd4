"""SGLang's `stop_regex`: the output ends where one of these regular expressions matches it.

Rules (the stop-string rules of detokenizer.py, with patterns instead of strings):
- the patterns are searched in the output text after every token; the first complete match ends
  the request (finish_reason "stop", matched_stop the pattern) and the output is cut before the
  matched text, which is never sent;
- text that could still become the start of a match (the `regex` module's partial matching) is
  held back until it either completes a match or can no longer be one, so a stream never sends text
  that a later match would have cut; `finish()` releases what is held, or cuts it at a complete match.
Patterns use Python's regex syntax (the `regex` module, a superset of `re`); they are compiled once
per pattern (LRU) and checked here before a request is queued (`check_stop_regexes`: a 400 naming
the field for a pattern that does not compile, is too long, or matches the empty text).

Cost rule: a pattern may backtrack without end (nested repetition such as `(.*a){12}Q`), and every token
searches the held text again, so one request's searches together get a time budget
(`STOP_REGEX_BUDGET_S` of search time, counted over the whole output); a search that would pass it
raises `StopRegexBudgetExceeded` (the request then ends as a 400 naming `stop_regex`). Searches
release the GIL (`concurrent=True`), so a matcher run in a worker thread never holds the event loop.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import regex

from tokenizer_proc.http.errors import bad_request

MAX_STOP_REGEXES = 16
MAX_STOP_REGEX_CHARS = 1024
STOP_REGEX_BUDGET_S = 2.0
"""Search time one request's stop_regex patterns may take over its whole output."""


class StopRegexBudgetExceeded(Exception):
    """The patterns' searches took the request's whole budget; the message says so to the client."""

    def __init__(self, budget_s: float) -> None:
        super().__init__(f"stop_regex: matching the patterns against the output took more than the {budget_s:g} s "
                         "a request may take; simplify the pattern (nested repetition such as (.*a){12} "
                         "backtracks without end)")


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> regex.Pattern[str]:
    return regex.compile(pattern)


def check_stop_regexes(value: str | list[str] | None, param: str) -> tuple[str, ...]:
    """The patterns of a `stop_regex` field (a string or a list), each compiled; ApiError 400 naming
    `param` for one that is empty, too long, invalid, or that matches the empty text (it would end
    every output before its first character)."""
    patterns = [value] if isinstance(value, str) else list(value or [])
    if len(patterns) > MAX_STOP_REGEXES:
        raise bad_request(f"{param} has {len(patterns)} patterns; at most {MAX_STOP_REGEXES}", param)
    for p in patterns:
        if not p or len(p) > MAX_STOP_REGEX_CHARS:
            raise bad_request(f"{param} patterns must be 1..{MAX_STOP_REGEX_CHARS} characters long", param)
        try:
            compiled = _compiled(p)
        except (regex.error, OverflowError) as e:
            raise bad_request(f"{param}: {p!r} is not a valid regular expression: {e}", param) from e
        if compiled.fullmatch("") is not None:
            raise bad_request(f"{param}: {p!r} matches the empty text, so every output would end at once", param)
    return tuple(dict.fromkeys(patterns))


class StopRegexMatcher:
    """Finds the first match of any of `patterns` in a stream of text pieces (one per token).

    Owns the output text so far (`_text`) and the offset up to which it has been released
    (`_sent`); everything from `_sent` on is held: the leftmost place where a match could still be
    completing. A search covers `_text[_sent:]` with the whole text as context (anchors and
    lookbehinds see what was released)."""

    def __init__(self, patterns: Sequence[str], budget_s: float = STOP_REGEX_BUDGET_S):
        self.patterns = tuple(patterns)
        self._compiled = [_compiled(p) for p in self.patterns]
        self._text = ""
        self._sent = 0
        self.matched: str | None = None
        self.budget_s = budget_s
        self.spent_s = 0.0  # search time so far; never more than budget_s without raising

    def _search(self, pat: regex.Pattern[str], partial: bool) -> regex.Match[str] | None:
        """`pat` searched in the held text within what is left of the budget (StopRegexBudgetExceeded past it)."""
        left = self.budget_s - self.spent_s
        if left <= 0:
            raise StopRegexBudgetExceeded(self.budget_s)
        start = time.perf_counter()
        try:
            return pat.search(self._text, self._sent, partial=partial, timeout=left, concurrent=True)
        except TimeoutError as e:
            self.spent_s = self.budget_s
            raise StopRegexBudgetExceeded(self.budget_s) from e
        finally:
            self.spent_s = min(self.budget_s, self.spent_s + time.perf_counter() - start)

    def push(self, text: str) -> str:
        """The text that is now safe to send; sets `matched` when a pattern matched. Raises
        StopRegexBudgetExceeded when the searches pass the budget (the text pushed is then lost)."""
        if self.matched is not None:
            return ""
        self._text += text
        if not self._compiled:
            return self._release(len(self._text))
        at = self._first_match()
        if at >= 0:
            return self._release(at, final=True)
        hold = len(self._text)
        for pat in self._compiled:
            m = self._search(pat, partial=True)
            if m is not None and m.partial:
                hold = min(hold, m.start())
        return self._release(hold)

    def _first_match(self) -> int:
        """Start of the leftmost complete match in the held text (the first pattern wins a tie);
        -1 if none. Sets `matched`."""
        best, best_at = None, -1
        for p, pat in zip(self.patterns, self._compiled, strict=True):
            m = self._search(pat, partial=False)
            if m is not None and (best_at < 0 or m.start() < best_at):
                best, best_at = p, m.start()
        self.matched = best
        return best_at

    def _release(self, upto: int, final: bool = False) -> str:
        out = self._text[self._sent : upto]
        self._sent = upto
        if final:
            self._text = self._text[:upto]
        return out

    def finish(self) -> str:
        """The text ended: release what is held, cut at a complete match inside it."""
        if self.matched is not None:
            return ""
        at = self._first_match()
        return self._release(at if at >= 0 else len(self._text), final=at >= 0)

    def check_integrity(self) -> None:
        assert 0 <= self._sent <= len(self._text)
        assert 0.0 <= self.spent_s <= self.budget_s
        assert self.matched is None or self._sent == len(self._text), "text held after a match"
