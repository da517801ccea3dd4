"""The Responses API with --reasoning-parser, over HTTP with a fake backend: the output's reasoning is a
`reasoning` item (a `reasoning_text` part) before the message, streamed as response.reasoning_text
events that add up to it, counted in usage.output_tokens_details.reasoning_tokens; an output cut during
its reasoning has only the reasoning item; a reasoning item sent back as input is accepted."""

from __future__ import annotations

import os

import httpx

from shared.config import ServerArgs
from tests.tokenizer.conftest import FakeBackend, text_plan
from tests.tokenizer.test_app import serve, sse_events
from tokenizer_proc.requests.tokenizer import ChatConventions, TextTokenizer

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "chat_templates")
THOUGHT = "<think>\nTwo and two.\n\nFour.\n</think>\n\nIt is 4."
REASONING, ANSWER = "Two and two.\n\nFour.", "It is 4."


def _serve(model_dir: str, text: str, check) -> None:  # noqa: ANN001
    tok = TextTokenizer.from_dir(model_dir, chat=ChatConventions(os.path.join(TEMPLATES, "qwen3.jinja"), "auto",
                                                                 "qwen3"))  # fmt: skip
    args = ServerArgs(model_path=model_dir, max_new_tokens_limit=64, reasoning_parser="qwen3")
    serve(args, FakeBackend(plan=text_plan(text, per_out=3)), tok, check)


def test_reasoning_is_an_item_before_the_message(model_dir: str) -> None:
    n = len(THOUGHT.encode())
    tok = TextTokenizer.from_dir(model_dir)

    async def check(c: httpx.AsyncClient) -> None:
        body = {"input": "What is 2 + 2?", "max_output_tokens": n}
        r = (await c.post("/v1/responses", json=body)).json()
        assert [item["type"] for item in r["output"]] == ["reasoning", "message"], r
        assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": REASONING}]
        assert r["output"][1]["content"][0]["text"] == ANSWER
        assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == len(tok.encode(REASONING, False))
        events = sse_events((await c.post("/v1/responses", json={**body, "stream": True})).text)
        kinds = [e["type"] for e in events]
        assert kinds[2] == "response.output_item.added" and events[2]["item"]["type"] == "reasoning"
        deltas = [e for e in events if e["type"] == "response.reasoning_text.delta"]
        assert len(deltas) > 1 and "".join(e["delta"] for e in deltas) == REASONING
        done = kinds.index("response.reasoning_text.done")
        assert events[done]["text"] == REASONING and kinds[done + 1] == "response.output_item.done"
        first_text = kinds.index("response.output_text.delta")
        assert done < first_text and events[first_text]["output_index"] == 1
        final = events[-1]["response"]
        assert final["output"][0]["content"] == r["output"][0]["content"]
        assert final["output"][1]["content"][0]["text"] == ANSWER
        again = {"input": [{"role": "user", "content": "What is 2 + 2?"}, r["output"][0],
                           {"role": "user", "content": "Sure?"}], "max_output_tokens": 4}  # fmt: skip
        assert (await c.post("/v1/responses", json=again)).status_code == 200

    _serve(model_dir, THOUGHT, check)


def test_an_output_cut_while_reasoning_has_only_its_reasoning(model_dir: str) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        body = {"input": "What is 2 + 2?", "max_output_tokens": 12}
        r = (await c.post("/v1/responses", json=body)).json()
        assert [item["type"] for item in r["output"]] == ["reasoning"] and r["status"] == "incomplete"
        events = sse_events((await c.post("/v1/responses", json={**body, "stream": True})).text)
        assert not any(e["type"].startswith("response.output_text") for e in events)
        assert [item["type"] for item in events[-1]["response"]["output"]] == ["reasoning"]

    _serve(model_dir, THOUGHT, check)
