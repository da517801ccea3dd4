"""Memory sizing (issue 5): pools from explicit flags or from a budget split by
--mamba-full-memory-ratio; --max-running-requests clamped (with a warning) rather than refused."""

from __future__ import annotations

import pytest

from tests.e2e.server import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _sched_info(server) -> dict:
    with server.client() as client:
        return client.get("/get_server_info").json()["scheduler"]["server"]


def test_max_running_is_clamped_to_the_state_pool_and_serving_works() -> None:
    args = ["--max-mamba-cache-size", "16", "--max-total-tokens", "2000", "--max-running-requests", "64"]
    with running_server(args) as server:
        info = _sched_info(server)
        assert info["state_capacity"] == 16 and info["kv_capacity"] == 2000
        assert info["max_running_requests"] == 14  # 16 slots less an eighth kept for CoW/checkpoints
        assert "--max-running-requests 64 clamped to 14" in server.output
        with server.client() as client:
            r = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
            assert r.status_code == 200


def test_budget_split_follows_the_ratio() -> None:
    caps = {}
    for ratio in ("0.2", "0.8"):
        with running_server(["--mem-budget-gb", "0.05", "--mamba-full-memory-ratio", ratio]) as server:
            info = _sched_info(server)
            caps[ratio] = (info["kv_capacity"], info["state_capacity"])
    assert caps["0.8"][1] > 3 * caps["0.2"][1]  # four times the bytes for states
    assert caps["0.2"][0] > 3 * caps["0.8"][0]  # four times the bytes for KV
