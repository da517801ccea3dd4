"""The logprobs objects of the OpenAI endpoints, built per choice across streamed chunks.

Completions (`logprobs: k`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`;
`top_logprobs` is one `{token text: logprob}` per token holding the k most likely tokens plus the
chosen one (as vLLM does; with k = 0 the chosen one alone); `text_offset` counts characters from the start of
the choice's text (the echoed prompt included) and continues across streamed chunks. With echo the
prompt's tokens come first; the first prompt token has logprob null (nothing predicts it).
Chat (`logprobs: true`, `top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}`.
vLLM's `prompt_logprobs: k` (`prompt_logprobs`): null for the first prompt token, then per token
`{"<token id>": {"logprob", "rank", "decoded_token"}}` holding the prompt token (first) and the k most
likely alternatives; rank 1 is the most likely token, and -inf is written as -9999.0 (as vLLM does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizer_proc.requests.tokenizer import TextTokenizer

TopT = Sequence[tuple[int, float]]


class CompletionLogprobs:
    """One choice's completions logprobs, chunk by chunk (owned by the response of that choice)."""

    def __init__(self, tok: TextTokenizer, k: int) -> None:
        self.tok, self.k, self.offset = tok, k, 0

    def _top(self, chosen: int, lp: float | None, top: TopT | None) -> dict[str, float] | None:
        if self.k < 0 or lp is None:
            return None
        out = {self.tok.token_text(t): v for t, v in (top or [])[: self.k]}
        out.setdefault(self.tok.token_text(chosen), lp)
        return out

    def chunk(self, ids: Sequence[int], lps: Sequence[float | None], tops: Sequence[TopT] | None) -> dict[str, Any]:
        tokens = [self.tok.token_text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        lp_list = list(lps) + [None] * (len(ids) - len(lps))
        top_list = list(tops or []) + [None] * (len(ids) - len(tops or []))
        top_out = [self._top(t, lp, tp) for t, lp, tp in zip(ids, lp_list, top_list, strict=True)]
        return {"tokens": tokens, "token_logprobs": lp_list,
                "top_logprobs": top_out if self.k >= 0 else None, "text_offset": offsets}

    def prompt(self, ids: Sequence[int], lps: Sequence[float] | None, tops: Sequence[TopT] | None) -> dict[str, Any]:
        """The echoed prompt's part: token 0 has no logprob; tokens 1.. have `lps`."""
        return self.chunk(ids, [None, *(lps or [])], [[], *(tops or [])])


def merge_completion(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    has_top = any(p["top_logprobs"] is not None for p in parts)
    for p in parts:
        out["tokens"] += p["tokens"]
        out["token_logprobs"] += p["token_logprobs"]
        out["text_offset"] += p["text_offset"]
        out["top_logprobs"] += p["top_logprobs"] or [None] * len(p["tokens"])
    if not has_top:
        out["top_logprobs"] = None
    return out


def chat_logprobs(tok: TextTokenizer, ids: Sequence[int], lps: Sequence[float | None],
                  tops: Sequence[TopT] | None) -> dict[str, Any]:
    top_list = list(tops or []) + [[]] * (len(ids) - len(tops or []))
    content = [
        {"token": tok.token_text(t), "logprob": lp, "bytes": tok.token_bytes(t),
         "top_logprobs": [{"token": tok.token_text(a), "logprob": v, "bytes": tok.token_bytes(a)} for a, v in top]}
        for t, lp, top in zip(ids, lps, top_list, strict=False)
    ]
    return {"content": content}


def _finite(lp: float) -> float:
    return lp if lp != float("-inf") else -9999.0


def prompt_logprobs(tok: TextTokenizer, ids: Sequence[int], lps: Sequence[float] | None, tops: Sequence[TopT] | None,
                    ranks: Sequence[int] | None, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs of prompt `ids` (module doc): `lps`, `tops` and `ranks` are those of
    tokens 1.. (a rank the engine did not give is taken from the alternatives, else null)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    tops, ranks = list(tops or []), list(ranks or [])
    for i, (t, lp) in enumerate(zip(ids[1:], lps or [], strict=False)):
        alts = list(tops[i] if i < len(tops) else [])[:k]
        rank = ranks[i] if i < len(ranks) else next((r for r, (a, _) in enumerate(alts, 1) if a == t), None)
        entry = {str(t): {"logprob": _finite(lp), "rank": rank, "decoded_token": tok.token_text(t)}}
        for r, (a, v) in enumerate(alts, 1):
            entry.setdefault(str(a), {"logprob": _finite(v), "rank": r, "decoded_token": tok.token_text(a)})
        out.append(entry)
    return out
