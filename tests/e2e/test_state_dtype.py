"""A real launch.py with `--mamba-ssm-dtype int8`: prefix-cache hits on quantized states, and the flag's CLI error."""

from __future__ import annotations

import random
import subprocess
import sys

import httpx
import pytest

from tests.e2e.server import DETERMINISTIC, ROOT, free_port, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHUNK = 64
SYSTEM = 300


def _greedy(client: httpx.Client, ids: list[int], n: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_int8_state_server_hits_the_prefix_cache_and_resumes_losslessly() -> None:
    """Prompts sharing a system prompt hit its int8 state from the third on, and a conversation turn
    resumes from the previous prompt's end. A completion with n = 2 computes its prompt once: the
    first choice stops one token short (the state there is checkpointed, quantized) and then goes on
    from its own slot, the second resumes from the checkpoint's copy; both compute the last prompt
    token from the same values and scales only if the copy is lossless, so (deterministic mode) their
    logprobs are equal bit for bit. Logprobs, not only tokens: the built-in model's greedy choices on
    random prompts barely depend on its Mamba states."""
    rng = random.Random(7)
    system = [rng.randrange(256) for _ in range(SYSTEM)]
    suffixes = [[rng.randrange(256) for _ in range(40)] for _ in range(5)]
    args = ["--mamba-ssm-dtype", "int8", "--chunked-prefill-size", str(CHUNK), *DETERMINISTIC]
    with running_server(args) as server, server.client() as client:
        results = [_greedy(client, system + suffix, 12) for suffix in suffixes[:4]]
        for i, res in enumerate(results):
            assert len(res["output_ids"]) == 12
            if i >= 2:
                assert res["meta_info"]["cached_tokens"] >= SYSTEM - CHUNK, (i, res["meta_info"])
        turn = system + suffixes[1] + results[1]["output_ids"] + [rng.randrange(256) for _ in range(10)]
        res = _greedy(client, turn, 8)
        assert res["meta_info"]["cached_tokens"] >= SYSTEM + 40, res["meta_info"]
        body = {"model": "hyssm-tiny", "prompt": system + suffixes[4], "max_tokens": 8, "temperature": 0, "n": 2,
                "logprobs": 1}  # fmt: skip
        completion = client.post("/v1/completions", json=body)
        assert completion.status_code == 200, completion.text
        out = completion.json()
        first, second = (c["logprobs"]["token_logprobs"] for c in out["choices"])
        assert len(first) == 8 and first == second
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= SYSTEM - CHUNK
        assert server.metric("hyssm_prefix_cache_hit_tokens_total", kind="state") >= 3 * (SYSTEM - CHUNK)
        assert server.metric("hyssm_checkpoints_total", result="saved") > 0
    assert "state dtype int8" in server.output  # the worker logs the state dtype and its bytes per slot
    assert "B per state slot" in server.output


def test_bad_state_dtype_is_a_one_line_cli_error() -> None:
    cmd = [sys.executable, "launch.py", "--device", "cpu", "--port", str(free_port()), "--mamba-ssm-dtype", "fp8"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, start_new_session=True)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--mamba-ssm-dtype" in lines[0], res.stderr
