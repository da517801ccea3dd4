"""Output constraints no output can satisfy, against a real server with the built-in model (one byte
per token): each is the client's fault, a 400 naming the problem, never a 503 ("retry later").
Those empty from the start or after the text they force are refused before queuing (a plain 400
naming the field, streamed or not); those that empty only after a choice, or that min_tokens keeps
from completing, end at run time as rejected (a 400; streamed: an error event with code 400, then
`data: [DONE]`; Responses: response.failed with code invalid_prompt). The server serves on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.server import Server, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "hyssm-tiny"
CHAT, COMP, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MSGS = [{"role": "user", "content": "hi"}]
NOTHING = r"[^\s\S]"  # no string matches it
AFTER_CHOICE = r"(a|b)[^\s\S]"  # empty too, but only after its first character, a choice


def _schema(pattern: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}


def _text_format(pattern: str) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "x", "schema": _schema(pattern), "strict": True}}


def _body(path: str, **fields: Any) -> dict[str, Any]:
    if path == RESP:
        return {"model": MODEL, "input": "hi", "max_output_tokens": 30, **fields}
    return {"model": MODEL, **({"messages": MSGS} if path == CHAT else {"prompt": "hi"}), "max_tokens": 30,
            **fields}


# (id, path, fields, the field a refusal before queuing names (None: found at run time), message part)
CASES: list[tuple[str, str, dict[str, Any], str | None, str]] = [
    ("chat-guided_regex-empty", CHAT, {"guided_regex": NOTHING}, "guided_regex", "no text satisfies it"),
    ("completions-guided_regex-empty", COMP, {"guided_regex": NOTHING}, "guided_regex", "no text satisfies it"),
    ("responses-impossible-pattern", RESP, {"text": _text_format(NOTHING)}, "response_format.json_schema.schema",
     "no text satisfies it (nothing can follow '{\"s\": \"')"),
    ("chat-min_tokens-beyond-regex", CHAT, {"regex": "ab", "min_tokens": 5}, None,
     "min_tokens 5 cannot be met: the constraint is complete after 2 tokens"),
    ("completions-min_tokens-beyond-regex", COMP, {"regex": "ab", "min_tokens": 5}, None,
     "min_tokens 5 cannot be met: the constraint is complete after 2 tokens"),
    ("completions-dead-end-after-a-choice", COMP, {"guided_regex": AFTER_CHOICE}, None,
     "no token can continue the output under the constraint after 1 token (no text satisfies it)"),
    ("responses-dead-end-after-a-choice", RESP, {"text": _text_format(AFTER_CHOICE)}, None,
     "no token can continue the output under the constraint after 8 tokens"),
]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server([]) as srv:
        yield srv


def _events(text: str) -> list[Any]:
    data = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]", text
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize(("path", "fields", "param", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_constraint_no_output_satisfies_is_a_400(server: Server, path: str, fields: dict[str, Any],
                                                   param: str | None, message: str) -> None:
    with server.client() as client:
        r = client.post(path, json=_body(path, **fields))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert message in err["message"] and err["code"] == 400 and err["type"] == "invalid_request_error", err
        assert err["param"] == param, err

        r = client.post(path, json=_body(path, stream=True, **fields))
        if param is not None:  # refused before the response started: a plain 400, as unstreamed
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert message in r.json()["error"]["message"]
            return
        assert r.status_code == 200, r.text
        last = _events(r.text)[-1]
        if path == RESP:
            assert last["type"] == "response.failed", last
            assert last["response"]["error"]["code"] == "invalid_prompt"
            assert message in last["response"]["error"]["message"]
        else:
            assert last["error"]["code"] == 400 and message in last["error"]["message"], last


def test_the_server_serves_on_after_them(server: Server) -> None:
    with server.client() as client:
        for _, path, fields, _, _ in CASES:
            assert client.post(path, json=_body(path, **fields)).status_code == 400
        r = client.post(COMP, json=_body(COMP, guided_regex="ab", min_tokens=2))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab", r.text
        r = client.post(CHAT, json=_body(CHAT, max_tokens=5))
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
        r = client.post(RESP, json=_body(RESP, text=_text_format("[a-c]{3}")))
        assert r.status_code == 200, r.text
        assert re.fullmatch("[a-c]{3}", json.loads(r.json()["output"][0]["content"][0]["text"])["s"]), r.text
