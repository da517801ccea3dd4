"""End to end through a real launch.py, real processes, real HTTP (issue 3 acceptance)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import random
import time

import httpx
import openai
import pytest

from tests.e2e.server import Server, group_pids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]



def _generate(client: httpx.Client, ids: list[int], n: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_greedy_matches_runtime_alone(server: Server, reference_runner) -> None:
    from tests.model_driver import generate_greedy

    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 90))] for _ in range(32)]
    lengths = [rng.randint(1, 12) for _ in prompts]
    with server.client() as client, cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: _generate(client, *p), zip(prompts, lengths, strict=True)))
    for prompt, n, res in zip(prompts, lengths, results, strict=True):
        expected = generate_greedy(reference_runner, prompt, n)
        assert res["output_ids"] == expected
        assert res["meta_info"]["prompt_tokens"] == len(prompt)
        assert res["meta_info"]["completion_tokens"] == n


def _sse_events(response: httpx.Response) -> list[str]:
    events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]"
    return events[:-1]


def test_generate_streaming_equals_non_streaming(server: Server) -> None:
    body = {"text": "Hello, hybrid world", "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    with server.client() as client:
        whole = client.post("/generate", json=body).json()
        with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            chunks = [json.loads(e) for e in _sse_events(r)]
    assert chunks[-1]["text"] == whole["text"]  # SGLang streams cumulative text
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_openai_client_completions_and_chat(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60)
    model = client.models.list().data[0].id
    comp = client.completions.create(model=model, prompt="The cat", max_tokens=8, temperature=0)
    assert comp.usage.prompt_tokens > 0 and comp.choices[0].finish_reason in ("stop", "length")
    stream = client.completions.create(
        model=model, prompt="The cat", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == comp.choices[0].text
    assert usage is not None and usage.completion_tokens == comp.usage.completion_tokens
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    streamed = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    assert chat.usage.prompt_tokens_details is not None


def test_raw_http_chat_and_completions(server: Server) -> None:
    with server.client() as client:
        r = client.post("/v1/completions", json={"model": "hyssm-tiny", "prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 3
        r = client.post(
            "/v1/chat/completions",
            json={"model": "hyssm-tiny", "messages": [{"role": "user", "content": "yo"}], "max_tokens": 3,
                  "stream": True},
        )
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def _server_info(client: httpx.Client) -> dict:
    r = client.get("/get_server_info")
    assert r.status_code == 200
    return r.json()


def _find(info: dict, key: str) -> int:
    """Look `key` up anywhere in the nested /get_server_info document."""
    stack = [info]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if key in node and not isinstance(node[key], dict):
                return node[key]
            stack.extend(node.values())
    raise KeyError(key)


def test_disconnect_mid_stream_frees_resources(server: Server) -> None:
    body = {"input_ids": list(range(40)), "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}}
    with server.client() as client:
        with client.stream("POST", "/generate", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
        assert _find(_server_info(client), "num_running") >= 0
        deadline = time.monotonic() + 30
        while True:  # poll the condition: the abort travels tokenizer -> scheduler asynchronously
            info = _server_info(client)
            if _find(info, "num_running") == 0 and _find(info, "kv_used_by_requests") == 0:
                break
            assert time.monotonic() < deadline, info
            time.sleep(0.1)
        assert _find(info, "state_used_by_requests") == 0


def test_flush_is_not_refused_for_the_servers_own_health_probe(server: Server) -> None:
    """A router probes /health every second and each probe is a one-token request: a /flush_cache arriving
    with a probe in flight waits for it instead of being refused as 'requests are running'."""

    async def health_then_flush(c: httpx.AsyncClient) -> tuple[int, int]:
        health = asyncio.ensure_future(c.get("/health"))
        await asyncio.sleep(0)  # lets the probe go out first; the assertion holds in either order
        flush = await c.post("/flush_cache")
        return (await health).status_code, flush.status_code

    async def rounds() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            return [await health_then_flush(c) for _ in range(20)]

    codes = asyncio.run(rounds())
    assert codes == [(200, 200)] * 20, codes


def _title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def test_a_launch_runs_its_processes_and_no_other(server: Server) -> None:
    """launch.py and the three processes it starts, nothing beside them (no helper process of the
    launcher's own for the server's life)."""
    titles = sorted(_title(pid) for pid in group_pids(server.pgid) if pid != server.pgid)
    assert titles == ["hyssm::scheduler", "hyssm::tokenizer", "hyssm::worker-tp0"], titles
