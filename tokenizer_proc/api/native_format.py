"""The response objects of POST /generate (SGLang's native API), one request's, shared by the
single answer (native.py) and the batches and `n` > 1 (native_batch.py).

`{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens",
"finish_reason", "e2e_latency"}}`; finish_reason is `{"type": "stop", "matched": <token id or stop
string>}`, `{"type": "length", "length": N}` or `{"type": "abort", "message": ...}`. With
`return_logprob`, `meta_info.output_token_logprobs` is `[[logprob, token_id, null], ...]`.
"""

from __future__ import annotations

import time
from typing import Any

from tokenizer_proc.http.errors import ApiError
from tokenizer_proc.requests.flow import Accumulated, finish_error
from tokenizer_proc.requests.generation import Finish
from tokenizer_proc.requests.prepare import PreparedRequest


def native_finish(finish: Finish | None, completion_tokens: int) -> dict[str, Any] | None:
    if finish is None:
        return None
    if finish.reason == "length":
        return {"type": "length", "length": completion_tokens}
    if finish.reason == "stop":
        return {"type": "stop", "matched": finish.matched}
    return {"type": finish.reason, "message": finish.message}


def payload(req: PreparedRequest, acc: Accumulated, started: float) -> dict[str, Any]:
    last = acc.last
    assert last is not None
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "cached_tokens": last.cached_tokens,
        "finish_reason": native_finish(last.finish, last.completion_tokens),
        "e2e_latency": time.monotonic() - started,
    }
    if req.return_logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(acc.logprobs, acc.ids, strict=False)]
        if req.sampling.top_logprobs:
            meta["output_top_logprobs"] = [[[v, a, None] for a, v in top] for top in acc.top_logprobs]
        if acc.prompt_logprobs is not None:
            meta["input_token_logprobs"] = input_logprobs(req, acc)
    return {"text": "".join(acc.text), "output_ids": list(acc.ids), "meta_info": meta}


def input_logprobs(req: PreparedRequest, acc: Accumulated) -> list[list[Any]]:
    """SGLang's input_token_logprobs: [logprob, token id, null] from logprob_start_len on (the
    first prompt token has logprob null)."""
    lps = [None, *(acc.prompt_logprobs or [])]
    rows = [[lp, t, None] for lp, t in zip(lps, req.input_ids, strict=False)]
    return rows[req.logprob_start_len:]


def error_of(finish: Finish | None) -> ApiError | None:
    """Backend failures become errors (abort is a normal finish on the native API)."""
    return finish_error(finish, abort_is_error=False)
