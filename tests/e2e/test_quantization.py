"""A real launch.py with `--quantization`: a quantized server answers the OpenAI API, its greedy text
stays with the unquantized server's, the worker logs what it quantized and the plan it chose; bad
values are one-line CLI errors."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from tests.e2e.server import ROOT, free_port, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROMPT = "Once upon a time there was a little robot who"


def _complete(client: httpx.Client) -> dict:
    body = {"model": "hyssm-tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_server_serves_and_stays_with_the_unquantized_one(fmt: str) -> None:
    with running_server(["--dtype", "float32"]) as server, server.client() as client:
        base = _complete(client)
    with running_server(["--dtype", "float32", "--quantization", fmt]) as server, server.client() as client:
        got = _complete(client)
        chat = client.post("/v1/chat/completions", json={"model": "hyssm-tiny", "max_tokens": 8,
                                                         "messages": [{"role": "user", "content": "Hello!"}]})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"], chat.text
    assert re.search(rf"quantized (\d+ \w+, )*\d+ {fmt}\b.* product weights", server.output)
    assert f"float32 {fmt}: rows 1" in server.output  # the plan's rule for the format's products
    same = sum(a == b for a, b in zip(got["logprobs"]["tokens"], base["logprobs"]["tokens"], strict=True))
    assert same >= 20, (got["text"], base["text"])


@pytest.mark.parametrize("flags,needle", [(["--quantization", "int3"], "--quantization"),
                                          (["--quantization", "int4", "--device", "cuda"], "CPU only")])
def test_bad_quantization_is_a_one_line_cli_error(flags: list[str], needle: str) -> None:
    cmd = [sys.executable, "launch.py", "--port", str(free_port()), *flags]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, start_new_session=True)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr
