"""The state store on Mooncake Store through real servers: a master and a standalone client hold the
entries, a restarted server loads a prefix the first one prefilled, with the same greedy tokens as a
server without a store (issue 57 acceptance: the prefix came back from Mooncake)."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e import test_state_store as exactness
from tests.e2e.server import DETERMINISTIC, running_server
from tests.e2e.test_state_store_shared import body, wait_for_writes
from tests.state_store.mooncake_service import mooncake_service

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BLOCK = 32


def test_a_restarted_server_loads_its_prefix_from_mooncake(tmp_path: Path) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(256) for _ in range(BLOCK * 6 + 9)]
    stored = (len(prompt) - 1) // BLOCK * BLOCK
    with running_server(DETERMINISTIC) as plain, plain.client() as client:
        reference = client.post("/generate", json=body(prompt, 10)).json()["output_ids"]
    with mooncake_service(tmp_path) as service:
        extra = json.dumps({"master_server_address": service.master_address})
        flags = ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", extra,
                 "--state-cache-block-tokens", str(BLOCK), *DETERMINISTIC]
        with running_server(flags) as first, first.client() as client:
            out = client.post("/generate", json=body(prompt, 10))
            assert out.status_code == 200, out.text
            assert out.json()["output_ids"] == reference
            wait_for_writes(first, stored // BLOCK + 1)
        with running_server(flags) as second, second.client() as client:
            out = client.post("/generate", json=body(prompt, 10))
            assert out.status_code == 200, out.text
            assert out.json()["output_ids"] == reference
            assert out.json()["meta_info"]["cached_tokens"] == stored
            assert second.metric("hyssm_state_store_loads_total", result="loaded") == 1


def test_an_unreachable_master_is_a_clear_start_up_error(tmp_path: Path) -> None:
    from tests.e2e.server import Server

    pytest.importorskip("mooncake.store", reason="Mooncake is not installed")
    extra = json.dumps({"master_server_address": "127.0.0.1:9"})
    server = Server(["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", extra])
    try:
        assert server.wait_exit(120) != 0
        assert "state store (mooncake" in server.output
    finally:
        server.stop()


@pytest.fixture
def on_mooncake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """test_state_store's exactness runs with every store on Mooncake: one master and standalone
    client per store folder the run names (the uninterrupted server's store apart from the restarted
    servers' one), all stopped at the end."""
    with contextlib.ExitStack() as stack:
        services: dict[str, str] = {}

        def store_args(folder: object) -> list[str]:
            name = str(folder)
            if name not in services:
                log_dir = tmp_path / f"mooncake-{len(services)}"
                services[name] = stack.enter_context(mooncake_service(log_dir)).master_address
            extra = json.dumps({"master_server_address": services[name]})
            return ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", extra,
                    "--state-cache-block-tokens", str(exactness.BLOCK)]

        monkeypatch.setattr(exactness, "store_args", store_args)
        yield


CASES = {
    "float32": [*DETERMINISTIC],
    "int8": ["--mamba-ssm-dtype", "int8", *DETERMINISTIC],
    "tp2": ["--tp-size", "2", "--max-running-requests", "8", *DETERMINISTIC],
    "ngram": ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4", *DETERMINISTIC],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_restart_exactness_through_mooncake(tmp_path: Path, on_mooncake: None, case: str) -> None:
    """The exactness runs of test_state_store.py (uninterrupted, fill, restart, flush) with the prefixes
    coming back from Mooncake: the Mamba2 hybrid at float32 and int8 states, TP=2, NGRAM drafts."""
    prompts = exactness.make_prompts(57, only=("x = kB+1", "x[", "shared[", "extends shared"))
    exactness.check_restart_exactness(CASES[case], tmp_path, prompts, f"mooncake-{case}")


def test_gated_deltanet_restart_exactness_through_mooncake(tmp_path: Path, on_mooncake: None) -> None:
    from tests.e2e.test_families import model_dir

    path = model_dir(tmp_path, "qwen3_5_dense")
    base = ["--model-path", path, "--dtype", "float32", *DETERMINISTIC]
    prompts = exactness.make_prompts(59, only=("x = kB+1", "shared[", "extends shared"))
    exactness.check_restart_exactness(base, tmp_path, prompts, "mooncake-qwen3_5_dense")
