"""The endpoints sglang-router reads, in SGLang's shapes, over a fake backend: /server_info and
/model_info (with their /get_ aliases), /get_load, /health_generate."""

from __future__ import annotations

import dataclasses

import httpx

from shared.config import ServerArgs
from shared.messages import SchedulerInfo, ServerState
from tests.tokenizer.conftest import FakeBackend
from tests.tokenizer.test_app import serve
from tokenizer_proc.requests.tokenizer import TextTokenizer


def test_server_info_has_sglangs_flat_fields(args: ServerArgs, backend: FakeBackend, tok: TextTokenizer) -> None:
    args = dataclasses.replace(args, served_model_name="tiny-a", tp_size=1, max_running_requests=7)

    async def check(c: httpx.AsyncClient) -> None:
        for path in ("/server_info", "/get_server_info"):
            info = (await c.get(path)).json()
            assert info["served_model_name"] == "tiny-a"
            assert info["model_path"] == args.resolved_model_path
            assert (info["tp_size"], info["dp_size"], info["max_running_requests"]) == (1, 1, 7)
            assert info["server_args"]["max_running_requests"] == 7  # hyssm's nested copy stays
            assert "scheduler" in info

    serve(args, backend, tok, check)


def test_model_info_names_the_architecture(args: ServerArgs, backend: FakeBackend, tok: TextTokenizer) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        for path in ("/model_info", "/get_model_info"):
            info = (await c.get(path)).json()
            assert info["architectures"] == ["GraniteMoeHybridForCausalLM"]
            kinds = info["layer_kinds"]
            assert "mamba" in kinds and "attention" in kinds
            assert info["state_kinds"] == {"mamba": "conv window + SSM state"}  # attention keeps KV, not a state
            assert info["model_path"] == info["tokenizer_path"] == args.resolved_model_path
            assert info["is_generation"] is True

    serve(args, backend, tok, check)


def test_get_load_counts_requests_and_tokens(args: ServerArgs, backend: FakeBackend, tok: TextTokenizer) -> None:
    backend.info_doc = SchedulerInfo(server=ServerState(num_running=3, num_waiting=2, kv_used_by_requests=41))

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.get("/get_load")
        assert r.status_code == 200
        assert r.json() == [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 41,
                             "num_queued_reqs": 0, "max_queued_reqs": args.max_queued_requests,
                             "num_refused_reqs": 0, "draining": False}]  # fmt: skip

    serve(args, backend, tok, check)


def test_load_and_health_generate_when_the_scheduler_is_gone(
    args: ServerArgs, backend: FakeBackend, tok: TextTokenizer
) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        assert (await c.get("/health_generate")).status_code == 200
        backend.healthy = False
        for path in ("/get_load", "/health_generate"):
            r = await c.get(path)
            assert r.status_code == 503, path
            assert r.json()["error"]["type"] == "service_unavailable"

    serve(args, backend, tok, check)


def test_health_generate_needs_no_api_key(args: ServerArgs, backend: FakeBackend, tok: TextTokenizer) -> None:
    args = dataclasses.replace(args, api_key="k")

    async def check(c: httpx.AsyncClient) -> None:
        assert (await c.get("/health_generate")).status_code == 200
        assert (await c.get("/get_load")).status_code == 401
        assert (await c.get("/get_load", headers={"Authorization": "Bearer k"})).status_code == 200

    serve(args, backend, tok, check)


ROUTER_GENERATE = {"model": None, "return_text_in_logprobs": False, "log_metrics": True, "return_hidden_states": False,
                   "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False}
ROUTER_OPENAI = {"no_stop_trim": False, "return_hidden_states": False}
ROUTER_CHAT = {**ROUTER_OPENAI, "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True}


def test_bodies_as_the_router_forwards_them(args: ServerArgs, backend: FakeBackend, tok: TextTokenizer) -> None:
    """sglang-router re-serializes every body with its own defaults for SGLang's extra fields:
    those are declared and served; asking for what they enable is a 400."""
    chat = {"model": args.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    comp = {"model": args.model_name, "prompt": "hi", "max_tokens": 2}
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}

    async def check(c: httpx.AsyncClient) -> None:
        for path, body, extra in (("/generate", gen, ROUTER_GENERATE), ("/v1/completions", comp, ROUTER_OPENAI),
                                  ("/v1/chat/completions", chat, ROUTER_CHAT)):  # fmt: skip
            r = await c.post(path, json={**body, **extra})
            assert r.status_code == 200, (path, r.text)
            for name, value in extra.items():
                if value is False and name not in ("no_logs",):
                    r = await c.post(path, json={**body, **extra, name: True})
                    assert r.status_code == 400 and r.json()["error"]["param"] == name, (path, name, r.text)

    serve(args, backend, tok, check)
