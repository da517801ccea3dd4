"""A real launch.py with `--speculative-algorithm NGRAM`: greedy outputs equal the model's own greedy
decoding without drafts (concurrent requests, prefix hits, streaming, n > 1), drafts are accepted on
text that repeats, structured output still holds (and takes drafts), and the metrics say how many drafts
were accepted."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import httpx
import openai
import pytest

from tests.e2e.server import DETERMINISTIC, ROOT, generate_concurrently, running_server
from tests.model_driver import generate_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


SPEC_ARGS = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4", "--chunked-prefill-size",
             "32", *DETERMINISTIC]  # fmt: skip


@pytest.fixture(scope="module")
def spec_server():
    with running_server(SPEC_ARGS) as srv:
        yield srv


def _repeating_prompts(reference_runner) -> list[list[int]]:
    """Prompts that end where the model's own greedy text begins again: its continuation repeats
    the prompt (what prompt lookup drafts)."""
    out = []
    for seed in ([72, 101, 108, 108, 111, 32], [84, 104, 101, 32], [65, 32, 115, 116]):
        text = generate_greedy(reference_runner, seed, 40)
        out.append(seed + text + seed)
    return out


def test_greedy_outputs_equal_decoding_without_drafts(spec_server, reference_runner) -> None:
    prompts = _repeating_prompts(reference_runner) + [[(31 * i + 7) % 250 for i in range(50)]]
    expected = [generate_greedy(reference_runner, p, 30) for p in prompts]
    got = asyncio.run(generate_concurrently(spec_server, prompts, 30))
    assert got == expected
    again = asyncio.run(generate_concurrently(spec_server, prompts[:2], 30))  # prefix hits this time
    assert again == expected[:2]
    accepted = spec_server.metric("hyssm_spec_accepted_tokens_total")
    steps = spec_server.metric("hyssm_spec_verify_steps_total")
    assert steps > 0 and accepted / steps > 1.0, (accepted, steps)


def test_streaming_n2_and_structured_output_with_drafts(spec_server, reference_runner) -> None:
    prompt = _repeating_prompts(reference_runner)[0]
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    pieces = []
    for chunk in client.completions.create(model="hyssm-tiny", prompt=prompt, max_tokens=24, temperature=0,
                                           stream=True):  # fmt: skip
        pieces.append(chunk.choices[0].text if chunk.choices else "")
    whole = client.completions.create(model="hyssm-tiny", prompt=prompt, max_tokens=24, temperature=0, n=2)
    assert "".join(pieces) == whole.choices[0].text == whole.choices[1].text
    sampled = [client.completions.create(model="hyssm-tiny", prompt=prompt, max_tokens=16, temperature=0.8,
                                         seed=5).choices[0].text for _ in range(2)]  # fmt: skip
    assert sampled[0] == sampled[1]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model="hyssm-tiny", messages=[{"role": "user", "content": "give a"}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert isinstance(json.loads(chat.choices[0].message.content)["a"], int)


def test_logprobs_with_drafts_are_those_decoding_without_them(reference_runner) -> None:
    """On a server of its own: whether a request drafts also follows what the server measured drafting
    to gain at its batch size, which the module's earlier requests would decide."""
    from shared.messages import SamplingParams
    from tests.model_driver import generate_speculative

    prompt = _repeating_prompts(reference_runner)[1]
    want: list = []
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    generate_speculative(reference_runner, prompt, 24, lambda tokens: [], params, want)
    body = {"model": "hyssm-tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 2}
    with running_server(SPEC_ARGS) as server:
        lp = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
        assert server.metric("hyssm_spec_accepted_tokens_total") > 0  # this request took drafts
    assert lp["token_logprobs"] == pytest.approx([w[0] for w in want], abs=1e-6)
    assert [sorted(t.values(), reverse=True) for t in lp["top_logprobs"]] == [
        pytest.approx([v for _, v in w[1]], abs=1e-5) for w in want]  # (log_softmax over more rows)


def test_structured_output_takes_drafts_and_keeps_its_output(spec_server, reference_runner) -> None:
    from shared.messages import GrammarSpec, SamplingParams
    from tests.model_driver import generate_speculative

    regex = "(ab|ba|abc){12}"  # repeats: prompt lookup finds drafts in the request's own output
    prompt = list(b"Pattern: ")
    params = SamplingParams(temperature=0.0, grammar=GrammarSpec(kind="regex", source=regex))
    want, _ = generate_speculative(reference_runner, prompt, 48, lambda tokens: [], params)
    steps = spec_server.metric("hyssm_spec_verify_steps_total")
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 48, "temperature": 0, "regex": regex}}
    for _ in range(3):
        out = httpx.post(spec_server.url + "/generate", json=body, timeout=60).json()
        assert out["output_ids"] == want[: len(out["output_ids"])] and len(out["output_ids"]) >= len(want) - 1
    assert spec_server.metric("hyssm_spec_verify_steps_total") > steps  # the grammar requests drafted


def test_bad_speculative_flags_are_one_line_errors() -> None:
    for flags, needle in ((["--speculative-algorithm", "EAGLE"], "invalid choice"),
                          (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "0"],
                           "--speculative-num-draft-tokens must be in [1, 16]")):  # fmt: skip
        res = subprocess.run([sys.executable, "launch.py", *flags], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 2 and needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def _mtp_model(tmp_path, family: str) -> str:
    from shared.config import builtin_model_dir
    from tests.mtp_checkpoint import write_mtp_checkpoint, write_nemotron_mtp_checkpoint

    write = {"qwen3_next": write_mtp_checkpoint, "nemotron_h": write_nemotron_mtp_checkpoint}[family]
    path = write(str(tmp_path / f"{family}_mtp"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(builtin_model_dir(), f), path)
    return path


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_nextn_drafts_with_the_mtp_layers_and_keeps_the_greedy_output(tmp_path, family: str) -> None:
    """The MTP layers guess every round's drafts (concurrent requests, chunked prompts, a second wave
    that hits the prefix cache); outputs equal the model's greedy decoding without drafts."""
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    path = _mtp_model(tmp_path, family)
    ref = ModelRunner(path, WorkerConfig(dtype="float32", kv_slots=600, state_slots=4, deterministic=True))
    system = [(7 * i + 3) % 200 + 3 for i in range(70)]
    prompts = [system + [(11 * i + j) % 200 + 3 for i in range(4 + j)] for j in range(4)]
    expected = [generate_greedy(ref, p, 20) for p in prompts]
    args = ["--model-path", path, "--dtype", "float32", "--speculative-algorithm", "NEXTN",
            "--speculative-num-draft-tokens", "3", "--chunked-prefill-size", "32", *DETERMINISTIC]  # fmt: skip
    with running_server(args) as server:
        for wave in range(2):
            assert asyncio.run(generate_concurrently(server, prompts, 20)) == expected, wave
        assert server.metric("hyssm_spec_verify_steps_total") > 0
        assert server.metric("hyssm_spec_draft_tokens_total") > 0
        assert server.metric("hyssm_prefix_cache_hit_tokens_total") > 0


def test_nextn_on_a_model_without_mtp_layers_is_a_one_line_error() -> None:
    res = subprocess.run([sys.executable, "launch.py", "--speculative-algorithm", "NEXTN"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2 and "no MTP layers" in res.stderr and len(res.stderr.strip().splitlines()) == 1, \
        res.stderr
