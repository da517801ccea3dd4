"""The persistent state store (issue 57) through real launch.py processes: prompts served after a
restart on a filled `--state-cache-dir` load their stored prefixes and produce the greedy tokens of a
server without a store, and, bit for bit, the tokens and logprobs of an uninterrupted server.

Per case (the built-in Mamba2 hybrid with float32 and int8 states, a Gated DeltaNet hybrid, TP=2,
NGRAM speculative decoding), with --enable-deterministic-inference and 32-token blocks:
- a reference server without a store runs every prompt once (greedy tokens);
- an uninterrupted server with a store of its own serves the fill prompts and then the restart
  prompts: its memory hits end where the restarted server's loads end, so it cuts every prefill where
  run 2 does and its logprobs are run 2's bit for bit (the server without a store cuts elsewhere: with
  a store a prefill is also cut at the prompt's last block end, and a different cut changes the last
  bits of a logprob even in the deterministic mode; greedy tokens stay equal);
- run 1 (store on, fresh folder) serves the fill prompts, and stops;
- run 2 (same folder) serves prompts that load what run 1 stored: the boundary rule (a stored prompt
  of k*B + 1 tokens loads k*B; the same prompt less its last token finds no state it may use; one of
  exactly k*B tokens loads (k-1)*B; that one plus a token loads the state stored at its end), two
  prompts sharing a stored prefix with different tails, and a prompt extending a stored one;
- run 3 (same folder) loads the extension run 2 wrote, to its last block end.
cached_tokens covers the stored prefix and never the last prompt token; loads are counted."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import httpx
import pytest

from tests.e2e.server import DETERMINISTIC, Server, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BLOCK = 32
NEW = 8  # greedy tokens per request


def store_args(folder: object) -> list[str]:
    return ["--state-cache-dir", str(folder), "--state-cache-block-tokens", str(BLOCK)]


def stored_end(prompt_len: int) -> int:
    """Where write-through stores a prompt's state: the last block end before its last token."""
    return (prompt_len - 1) // BLOCK * BLOCK


def generate(client: httpx.Client, ids: list[int], n: int = NEW) -> dict:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def answers(server: Server, prompts: list[list[int]], n: int = NEW) -> list[dict]:
    with server.client() as client:
        return [generate(client, p, n) for p in prompts]


def outcome(res: dict) -> tuple[list[int], list[float]]:
    """What must be equal bit for bit: the greedy tokens and their logprobs (the built-in model's greedy
    choices barely depend on its recurrent states; its logprobs do)."""
    return res["output_ids"], [row[0] for row in res["meta_info"]["output_token_logprobs"]]


@dataclass
class Prompts:
    """Run 1 fills the store with `fill`; run 2 sends `restart` (each with the prefix it must have loaded
    or hit at least); run 3 sends `extended` after run 2 stored it."""

    fill: list[list[int]]
    restart: list[tuple[str, list[int], int, bool]]  # (what, prompt, cached at least, same cuts as uninterrupted)
    extended: list[int]
    every: list[list[int]] = field(default_factory=list)


def make_prompts(seed: int, vocab_low: int = 3) -> Prompts:
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab_low, 256) for _ in range(n)]

    shared = toks(200)  # stored to 192
    x = toks(5 * BLOCK + 1)  # k*B + 1: its state at k*B is stored, the last token computed
    y = toks(5 * BLOCK)  # exactly k*B: stored to (k-1)*B (and the state after it, at k*B, at its end)
    extended = shared + toks(100)  # 300 tokens, extends the stored 200 (stored to 288 by run 2)
    restart = [
        ("x = kB+1: loads kB", x, stored_end(len(x)), True),
        # the state at kB now in memory (and in the store) contains this prompt's last token: not used
        ("x[:kB]", x[:-1], 0, True),
        ("y + 1 token: loads the state stored at y's end", y + toks(1), len(y), True),
        ("y = kB: loads (k-1)B", y, stored_end(len(y)), True),
        # two tails branching at shared's stored block end (the uninterrupted server hits its state there)
        ("shared[:192] + tail 1", shared[:192] + toks(30), stored_end(len(shared)), True),
        ("shared[:192] + tail 2", shared[:192] + toks(45), stored_end(len(shared)), True),
        # the uninterrupted server resumes from shared's prompt-end state at 200, not a block end
        ("extends shared", extended, stored_end(len(shared)), False),
    ]
    p = Prompts(fill=[shared, x, y], restart=restart, extended=extended)
    p.every = [*p.fill, *(q for _, q, _, _ in restart)]
    return p


RUN2_METRICS = ("hyssm_state_store_loaded_tokens_total", "hyssm_spec_verify_steps_total")


@dataclass
class Restarts:
    servers: dict[str, Server]  # run1, run2, run3 (stopped): their logs
    run2: dict[str, float]  # run 2's metrics: RUN2_METRICS and loads_total by result


def check_restart_exactness(base: list[str], tmp_path, prompts: Prompts, label: str) -> Restarts:
    """The reference, the uninterrupted server, runs 1, 2 and 3 of the module doc, on `base` flags."""
    folder = tmp_path / "store"
    restart_prompts = [p for _, p, _, _ in prompts.restart]
    with running_server(base) as ref_server:
        ref = {tuple(p): outcome(r)[0] for p, r in zip(prompts.every, answers(ref_server, prompts.every), strict=True)}
    with running_server([*base, *store_args(tmp_path / "uninterrupted")]) as plain:
        want_fill = [outcome(r) for r in answers(plain, prompts.fill)]
        want = answers(plain, restart_prompts)

    with running_server([*base, *store_args(folder)]) as run1:
        got_fill = [outcome(r) for r in answers(run1, prompts.fill)]
        assert run1.metric("hyssm_state_store_loads_total", result="started") == 0
    assert got_fill == want_fill, (label, "run 1")

    with running_server([*base, *store_args(folder)]) as run2:
        results = answers(run2, restart_prompts)
        metrics = {name: run2.metric(name) for name in RUN2_METRICS}
        for result in ("started", "loaded", "failed"):
            metrics[result] = run2.metric("hyssm_state_store_loads_total", result=result)
    for (what, p, at_least, same_cuts), res, plain_res in zip(prompts.restart, results, want, strict=True):
        assert res["output_ids"] == ref[tuple(p)], (label, "run 2 vs no store", what)
        if same_cuts:
            assert outcome(res) == outcome(plain_res), (label, "run 2 vs uninterrupted", what)
            assert res["meta_info"]["cached_tokens"] == plain_res["meta_info"]["cached_tokens"], (label, what)
        assert res["meta_info"]["cached_tokens"] >= at_least, (label, what, res["meta_info"])
        assert res["meta_info"]["cached_tokens"] <= len(p) - 1, (label, what, res["meta_info"])
    # x, y + 1, y and shared[:192] + tail 1 can only have come from the store (the others hit memory)
    loaded, failed, loaded_tokens = metrics["loaded"], metrics["failed"], metrics[RUN2_METRICS[0]]
    assert loaded == 4, (label, metrics, run2.output[-3000:])
    assert failed == 0, (label, metrics, run2.output[-3000:])
    assert metrics["started"] == loaded + failed, (label, metrics)
    assert loaded_tokens == 5 * BLOCK + 5 * BLOCK + 4 * BLOCK + stored_end(200), (label, metrics)

    with running_server([*base, *store_args(folder)]) as run3:
        (res,) = answers(run3, [prompts.extended])
        assert run3.metric("hyssm_state_store_loads_total", result="loaded") >= 1
    # run 2 cut the extension at the stored prefix and at its own last block end; run 3 loads the latter
    extended_in_run2 = results[restart_prompts.index(prompts.extended)]
    assert outcome(res) == outcome(extended_in_run2), (label, "run 3 vs run 2")
    assert res["output_ids"] == ref[tuple(prompts.extended)], (label, "run 3 vs no store")
    assert res["meta_info"]["cached_tokens"] >= stored_end(len(prompts.extended)), (label, res["meta_info"])
    return Restarts({"run1": run1, "run2": run2, "run3": run3}, metrics)


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_mamba2_hybrid_restart_equals_the_reference(tmp_path, state_dtype: str) -> None:
    base = ["--mamba-ssm-dtype", state_dtype, *DETERMINISTIC]
    out = check_restart_exactness(base, tmp_path, make_prompts(57), state_dtype)
    assert out.run2["started"] == out.run2["loaded"]


def test_gated_deltanet_hybrid_restart_equals_the_reference(tmp_path) -> None:
    from tests.e2e.test_families import model_dir

    path = model_dir(tmp_path, "qwen3_5_dense")
    base = ["--model-path", path, "--dtype", "float32", *DETERMINISTIC]
    check_restart_exactness(base, tmp_path, make_prompts(58), "qwen3_5_dense")


def test_tp2_restart_equals_the_reference(tmp_path) -> None:
    """Each rank stores its own slice under its own namespace folder; both load it back."""
    base = ["--tp-size", "2", "--max-running-requests", "8", *DETERMINISTIC]
    check_restart_exactness(base, tmp_path, make_prompts(59), "tp2")
    folders = [p for p in (tmp_path / "store").iterdir() if p.is_dir()]
    assert len(folders) == 2, folders  # one namespace per rank


def test_speculative_decoding_restart_equals_the_reference(tmp_path) -> None:
    """NGRAM drafts (the minimum match window is one token: random prompts draft too) verified on
    prefixes loaded from the store; the outputs are still the reference's."""
    base = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4", *DETERMINISTIC]
    out = check_restart_exactness(base, tmp_path, make_prompts(60), "ngram")
    assert out.run2["hyssm_spec_verify_steps_total"] > 0
