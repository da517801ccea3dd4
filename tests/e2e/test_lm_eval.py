"""lm-eval's `local-completions` model against a real launch.py, offline, on two tiny local JSON
tasks: a multiple-choice task (loglikelihood requests: token-id prompts in batches, echo, logprobs,
the remote tokenizer over /tokenizer_info, /tokenize, /detokenize) and a generate_until task. The
scores of the built-in model mean nothing; they must be produced, identical across two runs, and the
per-choice loglikelihoods must equal the server's own prompt logprobs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "hyssm-tiny"
DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0, "target": " blue"},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0, "target": " four"},
    {"question": "Fire is", "choices": [" hot", " cold", " wet"], "answer": 0, "target": " hot"},
]


@pytest.fixture(scope="module")
def server(api_server: Server) -> Server:
    return api_server


def _tasks(root: Path) -> Path:
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (root / "mc.yaml").write_text(
        "task: hyssm_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (root / "gen.yaml").write_text(
        "task: hyssm_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{target}}'\ngeneration_kwargs:\n  until: ['.']\n  max_gen_toks: 6\n"
        "metric_list:\n  - metric: exact_match\n")
    return root


def _run(server: Server, tasks: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = {"base_url": server.url + "/v1/completions", "model": MODEL, "tokenizer_backend": "remote",
            "num_concurrent": 1, "max_retries": 1, "timeout": 60}
    return lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["hyssm_mc", "hyssm_gen"],
                                   task_manager=TaskManager(include_path=str(tasks)), batch_size=2,
                                   log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def test_local_completions_runs_and_is_consistent(server: Server, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = _tasks(tmp_path)
    first, second = _run(server, tasks), _run(server, tasks)
    for name, metric in (("hyssm_mc", "acc,none"), ("hyssm_gen", "exact_match,none")):
        score = first["results"][name][metric]
        assert 0.0 <= score <= 1.0 and score == second["results"][name][metric]
    samples = first["samples"]["hyssm_mc"]
    assert len(samples) == len(DOCS)
    with httpx.Client(base_url=server.url, timeout=60) as c:

        def ids(text: str) -> list[int]:
            return c.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

        for s in samples:  # each choice's loglikelihood is the sum of its tokens' prompt logprobs
            assert len(s["arguments"]) == len(DOCS[s["doc_id"]]["choices"])
            for (context, continuation), resp in zip(s["arguments"], s["resps"], strict=True):
                ctx, cont = ids(context), ids(continuation)
                body = {"model": MODEL, "prompt": [ctx + cont], "max_tokens": 1, "logprobs": 1, "echo": True}
                lps = c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
                assert math.isclose(float(resp[0][0]), sum(lps[len(ctx):-1]), abs_tol=1e-3)
