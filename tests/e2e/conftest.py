from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from shared.config import builtin_model_dir
from tests.e2e.server import DETERMINISTIC, Server, running_server


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """One built-in-model server for the module (tight pools so capacity paths are exercised)."""
    with running_server(["--max-running-requests", "16", "--random-seed", "0", *DETERMINISTIC]) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference_runner():
    """The in-process model runtime: the expected output of each prompt run alone."""
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    return ModelRunner(
        builtin_model_dir(),
        WorkerConfig(device="cpu", dtype="float32", kv_slots=4096, state_slots=8, deterministic=True),
    )


@pytest.fixture(scope="session")
def api_server() -> Iterator[Server]:
    """One built-in-model server for the client-compatibility modules (test_api_clients,
    test_structured_clients, test_lm_eval): float32, and short prefill chunks so a prompt's
    logprobs are assembled from several slices."""
    with running_server(
        ["--random-seed", "0", "--dtype", "float32", "--chunked-prefill-size", "8", "--max-prefill-tokens", "64"]
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def openai_client(server: Server) -> openai.OpenAI:
    """The openai SDK against the module's `server` (the client-compatibility modules alias it to
    `api_server`)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
