"""Fixtures of the tokenizer-process tests: a small model dir (built-in tokenizer, short
context), the TextTokenizer, and FakeBackend, a deterministic stand-in for the scheduler."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import pytest

from shared.config import ServerArgs, builtin_model_dir
from shared.messages import GenerateReq, LoraAdapter, SchedulerInfo, ServerState, TokenOut
from tokenizer_proc.requests.generation import BackendUnavailable
from tokenizer_proc.requests.tokenizer import TextTokenizer

CONTEXT = 128  # max_position_embeddings of the test model
EOS = 256


def write_model_dir(path: str, context: int = CONTEXT) -> str:
    os.makedirs(path, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(builtin_model_dir(), name), os.path.join(path, name))
    config = {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "layer_types": ["mamba", "attention"],
        "num_hidden_layers": 2,
        "vocab_size": 260,
        "eos_token_id": EOS,
        "bos_token_id": EOS,
        "max_position_embeddings": context,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="session")
def tok(model_dir: str) -> TextTokenizer:
    return TextTokenizer.from_dir(model_dir)


@pytest.fixture
def args(model_dir: str) -> ServerArgs:
    return ServerArgs(model_path=model_dir, max_new_tokens_limit=64, max_body_bytes=8192)


def text_plan(text: str, per_out: int = 1, stop: bool = False) -> Callable[[GenerateReq], list[list[int]]]:
    """Outputs the UTF-8 bytes of `text` (cycled), `per_out` tokens per TokenOut; `stop`: then EOS (the
    output ends by itself, given max_tokens over the length of `text`)."""
    data = [*text.encode(), *([EOS] if stop else [])]

    def plan(req: GenerateReq) -> list[list[int]]:
        ids = [data[i % len(data)] for i in range(req.sampling.max_new_tokens)]
        return [ids[i : i + per_out] for i in range(0, len(ids), per_out)]

    return plan


@dataclass
class FakeBackend:
    """Deterministic Backend: each request gets `plan(req)` as its TokenOuts (finished on the
    last one with "length", or "stop" when a token is in stop_token_ids / is EOS). `gate`, when
    set, is awaited before every output after the first `free_outputs`."""

    plan: Callable[[GenerateReq], list[list[int]]] = field(default_factory=lambda: text_plan("hello world "))
    healthy: bool = True
    cached_tokens: int = 0
    gate: asyncio.Event | None = None
    free_outputs: int = 1
    fail_with: str | None = None  # finish every request with this error after the first output
    submitted: list[GenerateReq] = field(default_factory=list)
    aborted: list[tuple[str, str]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    open_streams: set[str] = field(default_factory=set)
    info_doc: SchedulerInfo = field(default_factory=lambda: SchedulerInfo(server=ServerState()))
    flush_result: tuple[bool, str] = (True, "")
    lora_result: tuple[bool, str] = (True, "")  # the scheduler's answer to a load or an unload
    lora_calls: list[tuple[str, str]] = field(default_factory=list)  # ("load" | "unload", name)

    async def submit(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        if not self.healthy:
            raise BackendUnavailable("fake scheduler is down")
        self.submitted.append(req)
        self.open_streams.add(req.rid)
        try:
            chunks = self.plan(req)
            stops = set(req.sampling.stop_token_ids) | (set() if req.sampling.ignore_eos else {EOS})
            produced = 0
            for i, chunk in enumerate(chunks):
                if i >= self.free_outputs and self.gate is not None:
                    await self.gate.wait()
                await asyncio.sleep(0)  # let other tasks run between outputs, like a real stream
                if self.fail_with is not None and i > 0:
                    self.finished.append(req.rid)
                    yield TokenOut(rid=req.rid, token_ids=[], finished=True, finish_reason="error",
                                   error=self.fail_with)
                    return
                hit = next((j for j, t in enumerate(chunk) if t in stops), None)
                if hit is not None:
                    chunk = chunk[: hit + 1]
                produced += len(chunk)
                last = hit is not None or i == len(chunks) - 1
                reason = ("stop" if hit is not None else "length") if last else None
                if last:
                    self.finished.append(req.rid)
                yield TokenOut(
                    rid=req.rid, token_ids=chunk, finished=last, finish_reason=reason,
                    matched_stop_token=chunk[hit] if hit is not None else None,
                    prompt_tokens=len(req.input_ids), cached_tokens=self.cached_tokens,
                    completion_tokens=produced,
                    logprobs=[-0.5] * len(chunk) if req.sampling.logprobs else None,
                    top_logprobs=[[(t, -0.5), (EOS, -2.0)][: req.sampling.top_logprobs] for t in chunk]
                    if req.sampling.top_logprobs else None,
                    prompt_logprobs=[-1.0] * (len(req.input_ids) - 1)
                    if i == 0 and req.sampling.prompt_logprobs >= 0 else None,
                    prompt_top_logprobs=[[(t, -1.0)] for t in req.input_ids[1:]]
                    if i == 0 and req.sampling.prompt_logprobs > 0 else None,
                )
                if last:
                    return
        finally:
            self.open_streams.discard(req.rid)

    def abort(self, rid: str, reason: str) -> None:
        self.aborted.append((rid, reason))

    async def wait_output(self) -> None:
        await asyncio.Event().wait()  # only the probe's own answer counts here

    async def info(self) -> SchedulerInfo:
        if not self.healthy:
            raise BackendUnavailable("fake scheduler is down")
        return self.info_doc

    async def flush_cache(self, include_store: bool = False) -> tuple[bool, str]:
        return self.flush_result

    async def load_lora(self, adapter: LoraAdapter) -> tuple[bool, str]:
        self.lora_calls.append(("load", adapter.name))
        return self.lora_result

    async def unload_lora(self, name: str) -> tuple[bool, str]:
        self.lora_calls.append(("unload", name))
        return self.lora_result

    def check_integrity(self) -> None:
        """Every submitted request finished or was aborted; no output stream is left open."""
        ended = set(self.finished) | {rid for rid, _ in self.aborted}
        assert all(r.rid in ended for r in self.submitted), "a request neither finished nor aborted"
        assert not self.open_streams, f"streams left open: {self.open_streams}"


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    fake = FakeBackend()
    yield fake


@pytest.fixture(scope="session")
def vision_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3.5 checkpoint that sees (tests/fixtures/vision_model.py)."""
    from tests.fixtures.vision_model import make_vision_model

    return make_vision_model(str(tmp_path_factory.mktemp("vision")))
