"""LoRA adapters at the HTTP layer over a fake backend: the registry from --lora-paths, POST
/load_lora_adapter and /unload_lora_adapter, the adapter a request names (`model`, `lora_path`) reaching
GenerateReq.lora, /v1/models, and the 400 / 404 answers."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from shared.config import ServerArgs, builtin_model_dir
from tests.fixtures.lora_adapter import write_adapter
from tests.tokenizer.conftest import FakeBackend
from tests.tokenizer.test_app import serve
from tokenizer_proc.requests.tokenizer import TextTokenizer

GEN = {"text": "abc", "sampling_params": {"max_new_tokens": 2}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built-in model's config and tokenizer (what the adapter reader checks against), no weights."""
    path = str(tmp_path_factory.mktemp("base"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(builtin_model_dir(), name), path)
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("adapters"))
    return {
        "sql": write_adapter(os.path.join(root, "sql"), seed=1),
        "chat": write_adapter(os.path.join(root, "chat"), seed=2),
        "big": write_adapter(os.path.join(root, "big"), rank=128),
        "odd": write_adapter(os.path.join(root, "odd"), targets=("q_proj", "wqkv_fancy")),
        "empty": os.path.join(root, "empty"),
    }


@pytest.fixture(scope="module")
def tok_base(base_dir: str) -> TextTokenizer:
    return TextTokenizer.from_dir(base_dir)


def lora_args(base_dir: str, *paths: str, **kw: object) -> ServerArgs:
    return ServerArgs(model_path=base_dir, enable_lora=True, lora_paths=tuple(paths), max_body_bytes=8192,
                      max_new_tokens_limit=64, **kw)  # type: ignore[arg-type]


def test_lora_paths_register_at_start_and_requests_name_them(base_dir, adapters, tok_base) -> None:
    args = lora_args(base_dir, f"sql={adapters['sql']}", adapters["chat"])  # a bare path: named after its directory
    backend = FakeBackend()

    async def check(c: httpx.AsyncClient) -> None:
        models = (await c.get("/v1/models")).json()["data"]
        base = args.model_name
        assert [m["id"] for m in models] == [base, "sql", "chat"]
        assert models[0]["parent"] is None and all(m["parent"] == base for m in models[1:])
        assert models[1]["root"] == os.path.abspath(adapters["sql"])
        assert (await c.get("/v1/models/sql")).json()["parent"] == base
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "sql"})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "sql"
        comp = {"prompt": "a", "max_tokens": 2, "model": base}
        assert (await c.post("/v1/completions", json=comp)).status_code == 200
        assert (await c.post("/v1/completions", json={**comp, "lora_path": "chat"})).status_code == 200
        assert (await c.post("/generate", json={**GEN, "lora_path": "chat"})).status_code == 200
        r = await c.post("/generate", json={"text": ["a", "b", "c"], "lora_path": ["sql", None, "chat"],
                                            "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text

    serve(args, backend, tok_base, check)
    assert [r.lora for r in backend.submitted] == ["sql", "", "chat", "chat", "sql", "", "chat"]


def test_unknown_adapters_are_404_and_mismatches_400(base_dir, adapters, tok_base) -> None:
    backend = FakeBackend()

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"]
        r = await c.post("/generate", json={**GEN, "lora_path": "nope"})
        assert r.status_code == 404 and "LoRA adapter 'nope'" in r.json()["error"]["message"]
        r = await c.post("/generate", json={"text": ["a", "b"], "lora_path": ["sql"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        r = await c.post("/v1/completions", json={"prompt": "a", "model": "sql", "lora_path": "chat"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        assert (await c.get("/v1/models/nope")).status_code == 404

    serve(lora_args(base_dir, f"sql={adapters['sql']}", f"chat={adapters['chat']}"), backend, tok_base, check)
    assert not backend.submitted


def test_load_and_unload_over_http(base_dir, adapters, tok_base) -> None:
    backend = FakeBackend()

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapters["sql"]})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert "sql" in [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
        info = (await c.get("/get_server_info")).json()
        listed = [(a["name"], a["rank"], a["targets"]) for a in info["lora_adapters"]]
        layers = [f"model.layers.{i}.self_attn.{m}" for i in (2, 5) for m in ("q_proj", "v_proj")]
        assert listed == [("sql", 8, layers)]  # the model's layers the adapter changes
        assert (await c.post("/generate", json={**GEN, "lora_path": "sql"})).status_code == 200
        again = await c.post("/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapters["chat"]})
        assert again.status_code == 400 and "loaded already" in again.json()["error"]["message"]
        r = await c.post("/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200 and r.json()["success"] is True
        r = await c.post("/generate", json={**GEN, "lora_path": "sql"})
        assert r.status_code == 404
        assert (await c.post("/unload_lora_adapter", json={"lora_name": "sql"})).status_code == 404
        r = await c.post("/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapters["chat"]})
        assert r.status_code == 200  # the name is free again

    serve(lora_args(base_dir), backend, tok_base, check)
    assert backend.lora_calls == [("load", "sql"), ("unload", "sql"), ("load", "sql")]


@pytest.mark.parametrize("name,needle", [("big", "rank 128 exceeds --max-lora-rank 64"),
                                         ("odd", "'wqkv_fancy': GraniteMoeHybridForCausalLM has no linear layer"),
                                         ("empty", "is not a directory")])
def test_a_bad_adapter_is_400_with_the_readers_message(base_dir, adapters, tok_base, name, needle) -> None:
    backend = FakeBackend()

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/load_lora_adapter", json={"lora_name": name, "lora_path": adapters[name]})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert name not in [m["id"] for m in (await c.get("/v1/models")).json()["data"]]

    serve(lora_args(base_dir), backend, tok_base, check)
    assert not backend.lora_calls


def test_missing_weights_and_a_refusing_scheduler_are_400(base_dir, adapters, tok_base, tmp_path) -> None:
    partial = str(tmp_path / "partial")
    write_adapter(partial)
    os.remove(os.path.join(partial, "adapter_model.safetensors"))
    backend = FakeBackend(lora_result=(False, "replica 1: the LoRA adapter 'x' is loaded already"))

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/load_lora_adapter", json={"lora_name": "p", "lora_path": partial})
        assert r.status_code == 400 and "adapter_model.safetensors" in r.json()["error"]["message"]
        r = await c.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["sql"]})
        assert r.status_code == 400 and "replica 1" in r.json()["error"]["message"]
        assert (await c.post("/generate", json={**GEN, "lora_path": "x"})).status_code == 404

    serve(lora_args(base_dir), backend, tok_base, check)


def test_adapter_routes_and_fields_while_lora_is_off(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        for path, body in [("/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
                           ("/unload_lora_adapter", {"lora_name": "a"}), ("/generate", {**GEN, "lora_path": "a"})]:
            r = await c.post(path, json=body)
            assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"], (path, r.text)
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "a"})
        assert r.status_code == 404  # an unknown model, as without adapters

    serve(args, backend, tok, check)
    assert not backend.submitted and not backend.lora_calls
