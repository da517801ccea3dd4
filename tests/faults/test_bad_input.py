"""Malformed and hostile requests against a real server (issue 7): each gets a 4xx with a JSON
error body, and a normal request afterwards still succeeds."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.e2e.server import Server, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

GEN = "/generate"
COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]

# (name, path, raw body bytes or JSON-able object, headers)
CASES: list[tuple[str, str, object]] = [
    ("invalid json", COMP, b"{not json"),
    ("truncated json", CHAT, b'{"model": "hyssm-tiny", "messages": ['),
    ("json array body", COMP, [1, 2, 3]),
    ("json string body", GEN, "hello"),
    ("empty body", COMP, b""),
    ("invalid utf-8 body", COMP, b'{"model": "hyssm-tiny", "prompt": "\xff\xfe"}'),
    ("missing prompt", COMP, {"model": "hyssm-tiny", "max_tokens": 3}),
    ("missing messages", CHAT, {"model": "hyssm-tiny"}),
    ("empty prompt", COMP, {"model": "hyssm-tiny", "prompt": ""}),
    ("empty token list", COMP, {"model": "hyssm-tiny", "prompt": []}),
    ("empty messages", CHAT, {"model": "hyssm-tiny", "messages": []}),
    ("prompt wrong type", COMP, {"model": "hyssm-tiny", "prompt": 42}),
    ("max_tokens string", COMP, {"model": "hyssm-tiny", "prompt": "a", "max_tokens": "ten"}),
    ("max_tokens negative", COMP, {"model": "hyssm-tiny", "prompt": "a", "max_tokens": -1}),
    ("max_tokens zero", COMP, {"model": "hyssm-tiny", "prompt": "a", "max_tokens": 0}),
    ("max_tokens huge", COMP, {"model": "hyssm-tiny", "prompt": "a", "max_tokens": 10**12}),
    ("temperature negative", COMP, {"model": "hyssm-tiny", "prompt": "a", "temperature": -0.5}),
    ("temperature string", CHAT, {"model": "hyssm-tiny", "messages": MSGS, "temperature": "hot"}),
    ("top_p zero", COMP, {"model": "hyssm-tiny", "prompt": "a", "top_p": 0}),
    ("top_p above one", CHAT, {"model": "hyssm-tiny", "messages": MSGS, "top_p": 1.5}),
    ("top_k zero", GEN, {"text": "a", "sampling_params": {"top_k": 0}}),
    ("n zero", COMP, {"model": "hyssm-tiny", "prompt": "a", "n": 0}),
    ("unknown model", COMP, {"model": "x", "prompt": "a"}),
    ("suffix", COMP, {"model": "hyssm-tiny", "prompt": "a", "suffix": "b"}),
    ("logit_bias out of vocab", COMP, {"model": "hyssm-tiny", "prompt": "a", "logit_bias": {"99999": 1}}),
    ("penalty out of range", CHAT, {"model": "hyssm-tiny", "messages": MSGS, "frequency_penalty": 7}),
    ("token id out of vocab", COMP, {"model": "hyssm-tiny", "prompt": [1, 2, 10**9]}),
    ("negative token id", GEN, {"input_ids": [1, -5, 3]}),
    ("prompt longer than context", GEN, {"input_ids": [1] * 5000, "sampling_params": {"max_new_tokens": 1}}),
    ("text and input_ids both missing", GEN, {"sampling_params": {"max_new_tokens": 2}}),
    ("message without role", CHAT, {"model": "hyssm-tiny", "messages": [{"content": "hi"}]}),
    ("message content wrong type", CHAT, {"model": "hyssm-tiny", "messages": [{"role": "user", "content": 5}]}),
    ("stop wrong type", COMP, {"model": "hyssm-tiny", "prompt": "a", "stop": 12}),
    ("stream wrong type", COMP, {"model": "hyssm-tiny", "prompt": "a", "stream": "yes"}),
    ("seed wrong type", COMP, {"model": "hyssm-tiny", "prompt": "a", "seed": "lucky"}),
    ("sampling_params not an object", GEN, {"text": "a", "sampling_params": [1, 2]}),
]


KV_POOL = 2048


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    flags = ["--max-body-bytes", "65536", "--context-length", "4096", "--max-total-tokens", str(KV_POOL)]
    with running_server(flags) as srv:
        yield srv


def _post(server: Server, path: str, body: object, **headers: str):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with server.client() as client:
        return client.post(path, content=data, headers={"Content-Type": "application/json", **headers})


@pytest.mark.parametrize(("name", "path", "body"), CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_4xx_json(server: Server, name: str, path: str, body: object) -> None:
    r = _post(server, path, body)
    assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    ok = _post(server, COMP, {"model": "hyssm-tiny", "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_huge_body_is_413(server: Server) -> None:
    r = _post(server, COMP, {"model": "hyssm-tiny", "prompt": "a" * 200_000})
    assert r.status_code == 413 and "error" in r.json()


def test_error_names_the_field(server: Server) -> None:
    r = _post(server, COMP, {"model": "hyssm-tiny", "prompt": "a", "max_tokens": "ten"})
    assert "max_tokens" in r.json()["error"]["message"]
    r = _post(server, CHAT, {"model": "hyssm-tiny", "messages": MSGS, "top_p": 1.5})
    assert "top_p" in r.json()["error"]["message"]


GOOD = {
    GEN: {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
    COMP: {"model": "hyssm-tiny", "prompt": "ok", "max_tokens": 2},
    CHAT: {"model": "hyssm-tiny", "messages": MSGS, "max_tokens": 2},
}
HUGE = 10**24  # wider than 64 bits: it used to reach the scheduler's encoder (OverflowError, 500)
# (path, body, the field the 400 must name)
OVERSIZED_INTS: list[tuple[str, dict, str]] = [
    (GEN, {"text": "a", "priority": HUGE}, "priority"),
    (GEN, {"text": "a", "sampling_params": {"top_k": HUGE}}, "sampling_params.top_k"),
    (GEN, {"text": "a", "sampling_params": {"max_new_tokens": -HUGE}}, "sampling_params.max_new_tokens"),
    (GEN, {"text": "a", "sampling_params": {"seed": HUGE}}, "sampling_params.seed"),
    (GEN, {"input_ids": [1, HUGE]}, "input_ids"),
    (GEN, {"text": "a", "sampling_params": {"stop_token_ids": [HUGE]}}, "sampling_params.stop_token_ids"),
    (COMP, {"model": "hyssm-tiny", "prompt": "a", "top_k": HUGE}, "top_k"),
    (COMP, {"model": "hyssm-tiny", "prompt": "a", "max_tokens": HUGE}, "max_tokens"),
    (COMP, {"model": "hyssm-tiny", "prompt": [1, HUGE]}, "prompt"),
    (COMP, {"model": "hyssm-tiny", "prompt": [[1, HUGE]]}, "prompt"),
    (COMP, {"model": "hyssm-tiny", "prompt": "a", "n": HUGE}, "n"),
    (COMP, {"model": "hyssm-tiny", "prompt": "a", "logprobs": HUGE}, "logprobs"),
    (CHAT, {"model": "hyssm-tiny", "messages": MSGS, "top_k": HUGE}, "top_k"),
    (CHAT, {"model": "hyssm-tiny", "messages": MSGS, "seed": -HUGE}, "seed"),
    (CHAT, {"model": "hyssm-tiny", "messages": MSGS, "max_completion_tokens": HUGE}, "max_completion_tokens"),
    (CHAT, {"model": "hyssm-tiny", "messages": MSGS, "stop_token_ids": [3, HUGE]}, "stop_token_ids"),
    (CHAT, {"model": "hyssm-tiny", "messages": MSGS, "top_logprobs": HUGE}, "top_logprobs"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("path", "body", "field"), OVERSIZED_INTS,
                         ids=[f"{p}:{f}" for p, _, f in OVERSIZED_INTS])  # fmt: skip
def test_oversized_integer_is_400_naming_the_field(server: Server, path: str, body: dict, field: str,
                                                    stream: bool) -> None:  # fmt: skip
    r = _post(server, path, {**body, "stream": stream})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(field), err
    assert field.split(".")[-1] in err["message"], err
    assert "OverflowError" not in r.text
    ok = _post(server, path, GOOD[path] | {"stream": stream})
    assert ok.status_code == 200, ok.text
    if stream:
        assert ok.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [GEN, COMP, CHAT])
def test_request_that_can_never_fit_the_kv_pool_is_400_naming_its_size(server: Server, path: str,
                                                                       stream: bool) -> None:  # fmt: skip
    """3000 prompt tokens, 2048 KV slots: the request's fault, not a 503 that invites retries; a
    streamed one is refused before its response starts too (it used to get a 200 and an error event)."""
    ids = [(i % 200) + 3 for i in range(3000)]
    if path == GEN:
        body: dict = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}
    elif path == COMP:
        body = {"model": "hyssm-tiny", "prompt": ids, "max_tokens": 4}
    else:
        body = {"model": "hyssm-tiny", "messages": [{"role": "user", "content": "hello " * 500}], "max_tokens": 4}
    r = _post(server, path, {**body, "stream": stream})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error", err
    assert str(KV_POOL) in err["message"] and "KV" in err["message"], err
    ok = _post(server, COMP, {"model": "hyssm-tiny", "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
