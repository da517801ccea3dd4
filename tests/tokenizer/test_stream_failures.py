"""A stream whose backend fails unexpectedly still ends with an error event and [DONE] (issue 17,
defect 1: an exception while submitting gave an empty 200 body), and the rid is free afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.tokenizer.test_app import serve, sse_events

BODIES = {
    "/generate": {"input_ids": [1, 2], "rid": "r1"},
    "/v1/completions": {"prompt": [1, 2], "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_unexpected_error_in_a_stream_is_an_error_event(args, backend, tok, path: str) -> None:
    def boom(_req: object) -> list[list[int]]:
        raise OverflowError("cannot encode")

    backend.plan = boom

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post(path, json={**BODIES[path], "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        (err,) = [e for e in sse_events(r.text) if isinstance(e, dict) and "error" in e]
        assert err["error"]["code"] == 500 and "OverflowError" in err["error"]["message"]

    ctx = serve(args, backend, tok, check)
    assert len(ctx.in_flight) == 0  # the rid reservations were released
