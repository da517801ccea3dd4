"""Incremental detokenisation of one request's output: token ids in, safe text out.

Two rules hold for every piece of text returned by `IncrementalDetokenizer.push`:
1. it is complete UTF-8: a multi-byte character split across tokens is held back until its
   last byte arrives (an invalid byte sequence becomes U+FFFD, never raw bytes);
2. it cannot be the start of a stop string: text that could still grow into a stop string is
   held back; on a match the output is truncated before the stop string and nothing follows.
`finish()` releases what was held (an unfinished character at the very end becomes U+FFFD).

Per-token work is O(new bytes x stop strings), independent of the text produced so far: the
byte-level path decodes through an incremental UTF-8 decoder over a per-token byte table; other
tokenizers go through `tokenizers.decoders.DecodeStream`, which keeps a bounded window. stop_regex
patterns are the exception: their searches cover the held text and are bounded by a time budget
per request instead (`searches`; stop_regex.py).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tokenizer_proc.requests.stop_regex import StopRegexMatcher


class ByteTableStream:
    """Token ids -> text through a table of each token's bytes (byte-level tokenizers).
    Owns the incremental UTF-8 decoder state (at most 3 pending bytes) of one request."""

    def __init__(self, table: Sequence[bytes]):
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        table, n = self._table, len(self._table)
        data = b"".join(table[t] if 0 <= t < n else b"" for t in token_ids)
        return self._decoder.decode(data)

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)

    def check_integrity(self) -> None:
        pending, _ = self._decoder.getstate()
        assert len(pending) <= 3, "more than one partial UTF-8 character held back"


class DecodeStreamAdapter:
    """Token ids -> text for tokenizers whose decoder is not byte-level (SentencePiece style),
    through the tokenizers library's DecodeStream (it holds back incomplete characters)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._vocab = tokenizer.get_vocab_size(with_added_tokens=True)

    def push(self, token_ids: Sequence[int]) -> str:
        out: list[str] = []
        for t in token_ids:
            if 0 <= t < self._vocab:
                piece = self._stream.step(self._tokenizer, t)
                if piece:
                    out.append(piece)
        return "".join(out)

    def finish(self) -> str:
        return ""

    def check_integrity(self) -> None:
        pass


class StopStringMatcher:
    """Finds stop strings in a stream of text pieces, across piece boundaries.

    The output is the text truncated before the stop string that STARTS first in the whole
    text. Owns the held-back tail: from the earliest position where a stop string could still
    complete (the tail there is a proper prefix of a stop). A complete stop string found after
    that position is not final yet: a longer one starting earlier may still complete, so the
    decision waits for more text or for `finish()`. Everything before the tail is safe."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Return the text that is now safe to emit; sets `matched` on a stop string."""
        if self.matched is not None or not text:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        best_at, best = self._first_complete(buf)
        partial = min(self._partial_start(buf, stop) for stop in self.stops)
        if best_at >= 0 and best_at <= partial:  # nothing can start earlier any more
            self.matched, self._held = best, ""
            return buf[:best_at]
        self._held = buf[partial:]
        return buf[:partial]

    def _first_complete(self, buf: str) -> tuple[int, str]:
        """(start, stop) of the complete stop string that starts first in `buf`; (-1, "") if none."""
        best_at, best = -1, ""
        for stop in self.stops:
            at = buf.find(stop)
            if at >= 0 and (best_at < 0 or at < best_at):
                best_at, best = at, stop
        return best_at, best

    @staticmethod
    def _partial_start(buf: str, stop: str) -> int:
        """Smallest index i such that buf[i:] is a proper prefix of `stop` (len(buf) if none)."""
        i = buf.find(stop[0], max(0, len(buf) - len(stop) + 1))
        while i >= 0:
            if stop.startswith(buf[i:]):
                return i
            i = buf.find(stop[0], i + 1)
        return len(buf)

    def finish(self) -> str:
        """The text ended: no held prefix can complete any more. Release the held tail, cut
        before a complete stop string inside it (setting `matched`)."""
        out, self._held = self._held, ""
        if self.matched is not None:
            return ""
        at, stop = self._first_complete(out)
        if at >= 0:
            self.matched = stop
            return out[:at]
        return out

    def check_integrity(self) -> None:
        assert self.matched is None or self._held == "", "text held after a stop-string match"
        if self.stops:
            assert len(self._held) < max(len(s) for s in self.stops), "held more than a stop prefix"
            assert not self._held or any(s.startswith(self._held) for s in self.stops)
        else:
            assert self._held == ""


class IncrementalDetokenizer:
    """Per-request detokeniser: a token stream (byte table or DecodeStream), then stop strings, then
    stop_regex patterns (stop_regex.py; checked after every token). One per request, used only by
    that request's handler."""

    def __init__(self, stream: ByteTableStream | DecodeStreamAdapter, stops: Sequence[str] = (),
                 stop_regexes: Sequence[str] = ()):  # fmt: skip
        self._stream = stream
        self._stops = StopStringMatcher(stops)
        self._regexes = StopRegexMatcher(stop_regexes) if stop_regexes else None
        self._finished = False

    @property
    def searches(self) -> bool:
        """Whether push and finish search stop_regex patterns: each call may then take up to what is left
        of the patterns' time budget (stop_regex.py), so callers on an event loop run it in a thread."""
        return self._regexes is not None

    @property
    def matched_stop(self) -> str | None:
        """The stop string, or the stop_regex pattern, that ended the output, if one did."""
        if self._regexes is not None and self._regexes.matched is not None:
            return self._regexes.matched
        return self._stops.matched

    def push(self, token_ids: Sequence[int]) -> str:
        """Text made safe by these tokens. After a stop match, always "". Raises StopRegexBudgetExceeded
        when the stop_regex searches pass their budget."""
        if self._finished or self.matched_stop is not None:
            return ""
        if self._regexes is None:
            return self._stops.push(self._stream.push(token_ids))
        out = []
        for t in token_ids:
            out.append(self._regexes.push(self._stops.push(self._stream.push([t]))))
            if self._stops.matched is not None:  # no text follows a stop string: the held text is final
                out.append(self._regexes.finish())
            if self.matched_stop is not None:
                break
        return "".join(out)

    def finish(self) -> str:
        """The request ended: release everything still held. Call once, last."""
        if self._finished:
            return ""
        self._finished = True
        if self.matched_stop is not None:
            return ""
        text = self._stops.push(self._stream.finish()) + self._stops.finish()
        if self._regexes is None:
            return text
        return self._regexes.push(text) + self._regexes.finish()

    def check_integrity(self) -> None:
        self._stream.check_integrity()
        self._stops.check_integrity()
        if self._regexes is not None:
            self._regexes.check_integrity()
