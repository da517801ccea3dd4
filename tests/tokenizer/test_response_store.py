"""The Responses API store (requests/response_store.py): bounded in count and in bytes (each entry measured
as its JSON once, when stored), the least recently stored or used dropped until both bounds hold, a
response over the byte bound alone not stored and dropping nothing, deletes and replacements returning
their bytes; over HTTP (fake backend), a response too large to keep is a 404 afterwards whose message
names both bounds, and the flag is validated."""

from __future__ import annotations

import httpx
import pytest

from shared.config import ConfigError, ServerArgs
from tests.tokenizer.conftest import FakeBackend, text_plan
from tests.tokenizer.test_app import serve
from tokenizer_proc.requests.response_store import ResponseStore, entry_size
from tokenizer_proc.requests.schemas import ChatMessage


def _response(rid: str, pad: int = 0) -> dict:
    return {"id": rid, "object": "response", "user": "u" * pad}


def _put(store: ResponseStore, rid: str, pad: int = 0) -> bool:
    return store.put(rid, _response(rid, pad), [ChatMessage(role="user", content="hi")])


def _size(rid: str, pad: int = 0) -> int:
    return entry_size(_response(rid, pad), (ChatMessage(role="user", content="hi"),))


def test_entries_are_dropped_least_recent_first_until_the_bytes_fit() -> None:
    one = _size("r0", 1000)
    store = ResponseStore(capacity=100, max_bytes=3 * one)
    for i in range(3):
        assert _put(store, f"r{i}", 1000)
    assert len(store) == 3 and store.nbytes == 3 * one
    assert store.get("r0") is not None  # r0 is now the most recently used
    assert _put(store, "r3", 1000)
    assert store.get("r1") is None and [store.get(r) is not None for r in ("r0", "r2", "r3")] == [True] * 3
    assert _put(store, "big", 2000)  # needs two entries' room: the two least recent go
    assert store.get("r2") is None and store.get("r0") is None and store.get("r3") is not None
    assert store.nbytes == _size("big", 2000) + one <= store.max_bytes
    store.check_integrity()


def test_a_response_over_the_byte_bound_alone_is_not_stored_and_drops_nothing() -> None:
    store = ResponseStore(capacity=10, max_bytes=_size("r0", 500) * 2)
    assert _put(store, "r0", 500)
    assert not _put(store, "huge", 10_000)
    assert store.get("huge") is None and store.get("r0") is not None and len(store) == 1
    store.check_integrity()


def test_count_bound_still_holds_and_deletes_and_replacements_return_their_bytes() -> None:
    store = ResponseStore(capacity=2, max_bytes=1 << 20)
    for i in range(3):
        _put(store, f"r{i}")
    assert len(store) == 2 and store.get("r0") is None
    assert store.delete("r1") and not store.delete("r1")
    assert store.nbytes == _size("r2")
    _put(store, "r2", 300)  # stored again under its id: counted once, at its new size
    assert len(store) == 1 and store.nbytes == _size("r2", 300)
    store.check_integrity()


def test_check_integrity_notices_a_wrong_byte_count() -> None:
    store = ResponseStore(capacity=4, max_bytes=1 << 20)
    _put(store, "r0", 10)
    store._bytes += 1
    with pytest.raises(AssertionError):
        store.check_integrity()


def test_flag_is_validated() -> None:
    with pytest.raises(ConfigError, match="--max-stored-responses-bytes"):
        ServerArgs(max_stored_responses_bytes=0)
    assert ServerArgs().max_stored_responses_bytes == 256 * 1024 * 1024


def test_http_a_response_too_large_to_keep_is_a_404_naming_both_bounds(model_dir: str, tok) -> None:
    args = ServerArgs(model_path=model_dir, max_stored_responses_bytes=20_000)

    async def check(c: httpx.AsyncClient) -> None:
        small = (await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})).json()
        big = (await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "user": "u" * 30_000}))
        assert big.status_code == 200 and big.json()["user"] == "u" * 30_000  # answered, just not kept
        gone = await c.get(f"/v1/responses/{big.json()['id']}")
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
        assert "1024 most recently used" in gone.json()["error"]["message"]
        assert "20000 bytes" in gone.json()["error"]["message"]
        follow = await c.post("/v1/responses", json={"input": "more", "previous_response_id": big.json()["id"]})
        assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"
        assert (await c.get(f"/v1/responses/{small['id']}")).status_code == 200  # the big one dropped nothing

    ctx = serve(args, FakeBackend(plan=text_plan("ok ")), tok, check)
    assert len(ctx.responses) == 1
