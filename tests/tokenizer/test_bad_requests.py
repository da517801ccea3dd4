"""Malformed and hostile requests against the app: each is a 4xx JSON error naming the field,
nothing reaches the backend, and a normal request afterwards succeeds."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.tokenizer.conftest import FakeBackend
from tokenizer_proc import create_app

GEN, COMP, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]

# (name, path, body (bytes or JSON-able), status, text the error message must contain)
CASES: list[tuple[str, str, object, int, str]] = [
    ("invalid json", COMP, b"{not json", 400, "JSON"),
    ("truncated json", CHAT, b'{"messages": [', 400, "JSON"),
    ("array body", COMP, [1, 2], 400, "object"),
    ("empty body", GEN, b"", 400, "empty"),
    ("invalid utf-8", COMP, b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("missing prompt", COMP, {"max_tokens": 3}, 400, "prompt"),
    ("missing messages", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("unknown model", CHAT, {"model": "gpt-17", "messages": MSGS}, 404, "gpt-17"),
    ("unknown model completions", COMP, {"model": "x", "prompt": "a"}, 404, "model"),
    ("missing text and ids", GEN, {"sampling_params": {}}, 400, "input_ids"),
    ("text and ids", GEN, {"text": "a", "input_ids": [1]}, 400, "input_ids"),
    ("empty text", GEN, {"text": ""}, 400, "text"),
    ("empty input_ids", GEN, {"input_ids": []}, 400, "input_ids"),
    ("empty prompt", COMP, {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", COMP, {"prompt": []}, 400, "prompt"),
    ("empty prompt in a batch", COMP, {"prompt": ["a", ""]}, 400, "prompt[1]"),
    ("empty id list in a batch", COMP, {"prompt": [[1], []]}, 400, "prompt[1]"),
    ("mixed prompt list", COMP, {"prompt": [1, "a"]}, 400, "prompt"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("empty role", CHAT, {"messages": [{"role": " ", "content": "x"}]}, 400, "messages[0].role"),
    ("role not a string", CHAT, {"messages": [{"role": 3, "content": "x"}]}, 400, "role"),
    ("image part without its URL", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "text": "u"}]}]}, 400, "image_url"),
    ("unknown content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
     400, "type"),
    ("image to a text-only model", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "takes no images"),
    ("video part", CHAT, {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": "u"}]}]},
     400, "video input is not supported"),
    ("image_data to a text-only model", GEN, {"text": "a", "image_data": "AAAA"}, 400, "takes no images"),
    ("metadata wrong type", CHAT, {"messages": MSGS, "metadata": 3}, 400, "metadata"),
    ("max_tokens string", COMP, {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens zero", COMP, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", CHAT, {"messages": MSGS, "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens over limit", COMP, {"prompt": "a", "max_tokens": 65}, 400, "max_tokens"),
    ("max_tokens huge", COMP, {"prompt": "a", "max_tokens": 10**30}, 400, "max_tokens"),
    ("max_new_tokens bool", GEN, {"text": "a", "sampling_params": {"max_new_tokens": True}}, 400, "max_new_tokens"),
    ("prompt + max over context", GEN, {"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 29}},
     400, "context"),
    ("prompt longer than context", COMP, {"prompt": "x" * 200}, 400, "context"),
    ("both max fields", CHAT, {"messages": MSGS, "max_tokens": 2, "max_completion_tokens": 2}, 400,
     "max_completion_tokens"),
    ("temperature negative", COMP, {"prompt": "a", "temperature": -0.1}, 400, "temperature"),
    ("temperature string", CHAT, {"messages": MSGS, "temperature": "hot"}, 400, "temperature"),
    ("temperature overflow", COMP, b'{"prompt": "a", "temperature": 1e999}', 400, "temperature"),
    ("top_p zero", COMP, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("top_p above one", CHAT, {"messages": MSGS, "top_p": 1.5}, 400, "top_p"),
    ("top_k zero", GEN, {"text": "a", "sampling_params": {"top_k": 0}}, 400, "top_k"),
    ("top_k below -1", COMP, {"prompt": "a", "top_k": -2}, 400, "top_k"),
    ("min_p above one", COMP, {"prompt": "a", "min_p": 2}, 400, "min_p"),
    ("seed negative", COMP, {"prompt": "a", "seed": -1}, 400, "seed"),
    ("seed string", COMP, {"prompt": "a", "seed": "lucky"}, 400, "seed"),
    ("n zero", COMP, {"prompt": "a", "n": 0}, 400, "n"),
    ("n too large", CHAT, {"messages": MSGS, "n": 1000}, 400, "n"),
    ("n zero on /generate", GEN, {"text": "a", "sampling_params": {"n": 0}}, 400, "sampling_params.n"),
    ("mixed input_ids batch", GEN, {"input_ids": [1, [2]]}, 400, "input_ids"),
    ("empty text batch", GEN, {"text": []}, 400, "text"),
    ("empty prompt in a text batch", GEN, {"text": ["a", ""]}, 400, "text"),
    ("best_of below n", COMP, {"prompt": "a", "n": 3, "best_of": 2}, 400, "best_of"),
    ("best_of streamed", COMP, {"prompt": "a", "best_of": 2, "stream": True}, 400, "best_of"),
    ("suffix", COMP, {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("presence penalty above 2", CHAT, {"messages": MSGS, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency penalty below -2", COMP, {"prompt": "a", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("repetition penalty zero", COMP, {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("native repetition penalty", GEN, {"text": "a", "sampling_params": {"repetition_penalty": -1}}, 400,
     "sampling_params.repetition_penalty"),
    ("logit_bias key not an id", COMP, {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("logit_bias id out of vocab", COMP, {"prompt": "a", "logit_bias": {"999": 1}}, 400, "logit_bias"),
    ("logit_bias value too large", CHAT, {"messages": MSGS, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("min_tokens above max", COMP, {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("min_tokens negative", CHAT, {"messages": MSGS, "min_tokens": -1}, 400, "min_tokens"),
    ("top logprobs without logprobs", CHAT, {"messages": MSGS, "top_logprobs": 3}, 400, "top_logprobs"),
    ("top logprobs above 20", CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("completion logprobs 21", COMP, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("completion logprobs negative", COMP, {"prompt": "a", "logprobs": -1}, 400, "logprobs"),
    ("native top_logprobs_num", GEN, {"text": "a", "return_logprob": True, "top_logprobs_num": 30}, 400,
     "top_logprobs_num"),
    ("response_format unknown type", CHAT, {"messages": MSGS, "response_format": {"type": "yaml"}}, 400,
     "response_format"),
    ("functions", CHAT, {"messages": MSGS, "functions": [{"name": "f"}]}, 400, "functions"),
    ("tool call without function", CHAT,
     {"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]}, 400, "function"),
    ("stop wrong type", COMP, {"prompt": "a", "stop": 12}, 400, "stop"),
    ("stop empty string", COMP, {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("too many stops", COMP, {"prompt": "a", "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("stop id out of vocab", GEN, {"text": "a", "sampling_params": {"stop_token_ids": [260]}}, 400, "stop_token_ids"),
    ("token id out of vocab", COMP, {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("negative token id", GEN, {"input_ids": [1, -5, 3]}, 400, "input_ids"),
    ("nested ids out of vocab", COMP, {"prompt": [[300]]}, 400, "prompt"),
    ("stream wrong type", COMP, {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("stream_options without stream", COMP, {"prompt": "a", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("sampling_params not an object", GEN, {"text": "a", "sampling_params": [1]}, 400, "sampling_params"),
    ("empty rid", GEN, {"text": "a", "rid": ""}, 400, "rid"),
    ("body over the limit", COMP, {"prompt": "a" * 9000}, 413, "limit"),
]


@pytest.fixture(scope="module")
def shared_app(model_dir, tok):
    from shared.config import ServerArgs

    backend = FakeBackend()
    args = ServerArgs(model_path=model_dir, max_new_tokens_limit=64, max_body_bytes=8192)
    return create_app(args, backend, tok), backend  # type: ignore[arg-type]


async def _post(app, path: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, content=data, headers={"content-type": "application/json", **(headers or {})})


@pytest.mark.parametrize(("name", "path", "body", "status", "names"), CASES, ids=[c[0] for c in CASES])
def test_bad_request(shared_app, name: str, path: str, body: object, status: int, names: str) -> None:
    app, backend = shared_app
    before = len(backend.submitted)
    r = asyncio.run(_post(app, path, body))
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == status
    assert names in err["message"], err
    assert len(backend.submitted) == before, "a bad request reached the scheduler"
    ok = asyncio.run(_post(app, COMP, {"prompt": "ok", "max_tokens": 2}))
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "he"
    app.state.ctx.check_integrity()


def test_declared_oversize_body_is_rejected_before_reading(shared_app) -> None:
    app, _ = shared_app
    r = asyncio.run(_post(app, GEN, b"{}", {"content-length": "999999999"}))
    assert r.status_code == 413


def test_at_least_thirty_kinds() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize(("path", "body", "param"), [
    (GEN, {"text": "a", "sampling_params": {"top_p": 9}}, "sampling_params.top_p"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (COMP, {"prompt": "a", "max_tokens": "x"}, "max_tokens"),
    (COMP, {"prompt": "a", "top_p": 2}, "top_p"),
    (GEN, {"text": "a", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    (COMP, {"prompt": "a", "n": 0}, "n"),
    (COMP, {"prompt": ["a", ""]}, "prompt[1]"),
    (COMP, {"prompt": "a", "logit_bias": {"7": 500}}, "logit_bias"),
])
def test_error_param_names_the_field(shared_app, path: str, body: object, param: str) -> None:
    app, _ = shared_app
    r = asyncio.run(_post(app, path, body))
    assert r.status_code == 400 and r.json()["error"]["param"] == param
