"""The persistent state store (issue 57) through real launch.py processes: prompts served after a
restart on a filled `--state-cache-dir` load their stored prefixes and produce the greedy tokens of a
server without a store, and, bit for bit, the tokens and logprobs of an uninterrupted server.

Per case (the built-in Mamba2 hybrid with float32 and int8 states, with write-back instead of
write-through, a Gated DeltaNet hybrid, the attention-free Mamba2 fixture, TP=2, NGRAM speculative
decoding), with --enable-deterministic-inference and 32-token blocks:
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
- then the extension run 2 stored is loaded back to its last block end: in run 2 after /flush_cache
  emptied the memory tier, and (float32) by a run 3 on the same folder.
The Gated DeltaNet case asks a subset (its deterministic steps are slow). Last, every restart prompt
twice at once on small pools: concurrent loads of one prefix, and no slot lost.
cached_tokens covers the stored prefix and never the last prompt token; loads are counted."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx
import pytest

from tests.e2e.server import DETERMINISTIC, Server, generate_concurrently, running_server

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
    # wait_ready also returns when launch.py's output ended before its exit was seen: say why it did
    assert "hyssm: serving" in server.output, server.output[-4000:]
    with server.client() as client:
        return [generate(client, p, n) for p in prompts]


def outcome(res: dict) -> tuple[list[int], list[float]]:
    """What must be equal bit for bit: the greedy tokens and their logprobs (the built-in model's greedy
    choices barely depend on its recurrent states; its logprobs do)."""
    return res["output_ids"], [row[0] for row in res["meta_info"]["output_token_logprobs"]]


@dataclass(frozen=True)
class Ask:
    """One prompt of run 2: what it checks, the tokens cached for it at least (from the store or from
    memory), the tokens it loads from the store (0: none; run 2's loads add up to these), and whether the
    uninterrupted server cuts its prefill at the same positions (its memory hits end where run 2's loads do)."""

    name: str
    prompt: list[int]
    cached_at_least: int
    from_store: int
    same_cuts: bool = True


@dataclass
class Prompts:
    """Run 1 fills the store with `fill`; run 2 sends `restart` in order; `extended` (the last of them)
    is loaded to its last block end after run 2 stored it."""

    fill: list[list[int]]
    restart: list[Ask]
    extended: list[int]

    @property
    def restart_prompts(self) -> list[list[int]]:
        return [a.prompt for a in self.restart]

    @property
    def every(self) -> list[list[int]]:
        return [*self.fill, *self.restart_prompts]


SHARED = 200  # stored to 192
K = 5  # the boundary prompts: x of K*B + 1 tokens, y of K*B


def make_prompts(seed: int, only: tuple[str, ...] = ()) -> Prompts:
    """The prompts of the module doc (`only`: those run 2 asks, by name, in order)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(6, 256) for _ in range(n)]

    # distinct first tokens: prompts sharing only their first token would leave a branch-point state
    # there in the uninterrupted server's tree, which run 2's tree (filled by loads) has not
    shared = [3, *toks(SHARED - 1)]
    x = [4, *toks(K * BLOCK)]  # K*B + 1: its state at K*B is stored, its last token computed
    y = [5, *toks(K * BLOCK - 1)]  # K*B: stored to (K-1)*B, and (its prompt-end checkpoint) its state at K*B
    tails = toks(30), toks(45)
    for tail in tails:  # branching right at 192, not later
        tail[0] = tail[0] + 1 if tail[0] == shared[stored_end(SHARED)] else tail[0]
    extended = shared + toks(100)  # 300 tokens: extends the stored 200; run 2 stores it to 288
    base = stored_end(SHARED)
    restart = [
        Ask("x = kB+1: loads kB", x, K * BLOCK, K * BLOCK),
        # the state at K*B now in memory (and in the store) contains this prompt's last token: not used
        Ask("x[:kB]: no state it may use", x[:-1], 0, 0),
        Ask("y + 1 token: loads the state stored at y's end", y + toks(1), K * BLOCK, K * BLOCK),
        Ask("y = kB: loads (k-1)B", y, (K - 1) * BLOCK, (K - 1) * BLOCK),
        # two tails branching at shared's stored block end: the first loads, the second hits the tree
        Ask("shared[:192] + tail 1", shared[:base] + tails[0], base, base),
        Ask("shared[:192] + tail 2", shared[:base] + tails[1], base, 0),
        # hits the tree at 192; the uninterrupted server resumes from shared's prompt-end state at 200
        Ask("extends shared", extended, base, 0, same_cuts=False),
    ]
    if only:
        restart = [a for a in restart if a.name.split(":")[0] in only]
    return Prompts(fill=[shared, x, y], restart=restart, extended=extended)


@dataclass
class Restarts:
    servers: dict[str, Server]  # the stopped servers of run 1 and run 2 (and run 3): their logs
    run2: dict[str, float]  # run 2's loads by result and the metrics named in the call


def load_counts(server: Server) -> dict[str, float]:
    return {r: server.metric("hyssm_state_store_loads_total", result=r) for r in ("started", "loaded", "failed")}


def flush_memory(server: Server) -> None:
    """Empty the memory tier (the store keeps its entries)."""
    with server.client() as client:
        r = client.post("/flush_cache")
    assert r.status_code == 200, r.text


def check_restart_exactness(base: list[str], tmp_path, prompts: Prompts, label: str,
                            ref: dict[tuple[int, ...], list[int]] | None = None, run3: bool = False,
                            metrics: tuple[str, ...] = ()) -> Restarts:  # fmt: skip
    """The reference (`ref`: the greedy tokens of every prompt from a server without a store, computed
    here when None), the uninterrupted server, runs 1 and 2 of the module doc, on `base` flags. Then the
    extension run 2 stored is loaded back: after the memory tier is flushed in run 2 and, with `run3`,
    by a third server on the same folder."""
    folder = tmp_path / "store"
    if ref is None:
        ref = reference_ids(base, prompts.every)
    with running_server([*base, *store_args(tmp_path / "uninterrupted")]) as plain:
        want_fill = [outcome(r) for r in answers(plain, prompts.fill)]
        want = answers(plain, prompts.restart_prompts)

    with running_server([*base, *store_args(folder)]) as run1:
        got_fill = [outcome(r) for r in answers(run1, prompts.fill)]
        assert load_counts(run1)["started"] == 0
    assert got_fill == want_fill, (label, "run 1")

    with running_server([*base, *store_args(folder)]) as run2:
        results = answers(run2, prompts.restart_prompts)
        counts = {**load_counts(run2), **{name: run2.metric(name) for name in metrics}}
        loaded_tokens = run2.metric("hyssm_state_store_loaded_tokens_total")
        flush_memory(run2)
        (again,) = answers(run2, [prompts.extended])
        counts_after_flush = load_counts(run2)
    for ask, res, plain_res in zip(prompts.restart, results, want, strict=True):
        what = (label, ask.name, res["meta_info"])
        assert res["output_ids"] == ref[tuple(ask.prompt)], (*what, "run 2 vs no store")
        if ask.same_cuts:
            assert outcome(res) == outcome(plain_res), (*what, "run 2 vs uninterrupted")
            assert res["meta_info"]["cached_tokens"] == plain_res["meta_info"]["cached_tokens"], what
        assert ask.cached_at_least <= res["meta_info"]["cached_tokens"] <= len(ask.prompt) - 1, what
    loads = [a.from_store for a in prompts.restart if a.from_store]
    assert counts["loaded"] == len(loads) and counts["failed"] == 0, (label, counts, run2.output[-3000:])
    assert counts["started"] == counts["loaded"], (label, counts)
    assert loaded_tokens == sum(loads), (label, loaded_tokens, loads)

    # run 2 cut the extension at 192 and at its own last block end, 288, where a load of it ends
    extended_in_run2 = results[prompts.restart_prompts.index(prompts.extended)]
    assert counts_after_flush["loaded"] == counts["loaded"] + 1, (label, counts_after_flush)
    assert again["meta_info"]["cached_tokens"] == stored_end(len(prompts.extended)), (label, again["meta_info"])
    assert outcome(again) == outcome(extended_in_run2), (label, "after the flush vs run 2")
    servers = {"run1": run1, "run2": run2}
    if run3:
        with running_server([*base, *store_args(folder)]) as server:
            (res,) = answers(server, [prompts.extended])
            assert load_counts(server) == {"started": 1, "loaded": 1, "failed": 0}
        assert res["meta_info"]["cached_tokens"] == stored_end(len(prompts.extended)), (label, res["meta_info"])
        assert outcome(res) == outcome(extended_in_run2), (label, "run 3 vs run 2")
        servers["run3"] = server
    return Restarts(servers, counts)


def reference_ids(base: list[str], prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    with running_server(base) as server:
        return {tuple(p): r["output_ids"] for p, r in zip(prompts, answers(server, prompts), strict=True)}


@pytest.fixture(scope="module")
def builtin_ref() -> tuple[Prompts, dict[tuple[int, ...], list[int]]]:
    """The built-in model's prompts and their greedy tokens without a store (float32 states; the
    deterministic mode makes tokens independent of the TP size and of drafting)."""
    prompts = make_prompts(57)
    return prompts, reference_ids(DETERMINISTIC, prompts.every)


def test_mamba2_hybrid_restart_equals_the_reference(tmp_path, builtin_ref) -> None:
    prompts, ref = builtin_ref
    out = check_restart_exactness(DETERMINISTIC, tmp_path, prompts, "float32", ref=ref, run3=True)
    assert out.run2["loaded"] == 4


def test_write_back_restart_equals_the_reference(tmp_path, builtin_ref) -> None:
    """--hicache-write-policy write_back: nothing is written while the prefixes stay in memory; a graceful
    stop (and the flush of the memory tier) writes them, and the restarts load them as above."""
    prompts, ref = builtin_ref
    base = ["--hicache-write-policy", "write_back", *DETERMINISTIC]
    out = check_restart_exactness(base, tmp_path, prompts, "write_back", ref=ref, run3=True)
    assert out.run2["loaded"] == 4


def test_int8_states_restart_equals_the_reference(tmp_path) -> None:
    """int8 states are rounded where a prefill is cut: the uninterrupted server cuts where run 2 does."""
    base = ["--mamba-ssm-dtype", "int8", *DETERMINISTIC]
    check_restart_exactness(base, tmp_path, make_prompts(58), "int8")


def test_gated_deltanet_hybrid_restart_equals_the_reference(tmp_path) -> None:
    from tests.e2e.test_families import model_dir

    path = model_dir(tmp_path, "qwen3_5_dense")
    base = ["--model-path", path, "--dtype", "float32", *DETERMINISTIC]
    prompts = make_prompts(59, only=("x = kB+1", "x[", "shared[", "extends shared"))  # its steps are slow
    check_restart_exactness(base, tmp_path, prompts, "qwen3_5_dense")


def test_attention_free_mamba2_restart_equals_the_reference(tmp_path) -> None:
    """No attention layer: the store holds states only (no KV blocks), the token slots are bookkeeping."""
    from tests.e2e.test_families import model_dir

    path = model_dir(tmp_path, "mamba2")
    base = ["--model-path", path, "--dtype", "float32", *DETERMINISTIC]
    out = check_restart_exactness(base, tmp_path, make_prompts(64), "mamba2")
    assert out.run2["loaded"] == 4
    (ns,) = [p for p in (tmp_path / "store").iterdir() if p.is_dir()]
    assert len([f for sub in ns.iterdir() if sub.is_dir() for f in sub.iterdir()]) > 0


def test_tp2_restart_equals_the_reference(tmp_path, builtin_ref) -> None:
    """Each rank stores its own slice under its own namespace folder; both load it back."""
    prompts, ref = builtin_ref
    base = ["--tp-size", "2", "--max-running-requests", "8", *DETERMINISTIC]
    check_restart_exactness(base, tmp_path, prompts, "tp2", ref=ref)
    folders = [p for p in (tmp_path / "store").iterdir() if p.is_dir()]
    assert len(folders) == 2, folders  # one namespace per rank


def test_speculative_decoding_restart_equals_the_reference(tmp_path, builtin_ref) -> None:
    """NGRAM drafts (the minimum match window is one token: random prompts draft too) verified on
    prefixes loaded from the store; the outputs are still the reference's."""
    prompts, ref = builtin_ref
    base = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4", *DETERMINISTIC]
    out = check_restart_exactness(base, tmp_path, prompts, "ngram", ref=ref, metrics=("hyssm_spec_verify_steps_total",))
    assert out.run2["hyssm_spec_verify_steps_total"] > 0


def test_concurrent_loads_of_one_prefix_under_tight_pools(tmp_path, builtin_ref) -> None:
    """After a restart every restart prompt arrives twice at once on small pools: requests wait for loads
    of the same stored prefix, loads compete with running requests for slots (refusals, retries), and
    every answer is still the reference's; when all is done no slot is held or lost and no node locked."""
    prompts, ref = builtin_ref
    restart = prompts.restart_prompts
    folder = tmp_path / "store"
    with running_server([*DETERMINISTIC, *store_args(folder)]) as server:
        answers(server, prompts.fill)
    tight = ["--max-total-tokens", "700", "--max-mamba-cache-size", "6", "--max-running-requests", "4"]
    with running_server([*DETERMINISTIC, *tight, *store_args(folder)]) as server:
        got = asyncio.run(generate_concurrently(server, restart + restart, NEW))
        loads = load_counts(server)
        with server.client() as client:
            sched = client.get("/get_server_info").json()["scheduler"]["server"]
    want = [ref[tuple(p)] for p in restart]
    assert got == want + want
    assert loads["loaded"] >= 4 and loads["failed"] == 0, (loads, server.output[-3000:])
    assert loads["started"] == loads["loaded"], loads
    assert sched["kv_used_by_requests"] == 0 and sched["state_used_by_requests"] == 0, sched
    assert sched["num_locked_nodes"] == 0, sched
    assert sched["kv_free"] + sched["kv_cached"] == sched["kv_capacity"], sched
    assert sched["state_free"] + sched["state_cached"] == sched["state_capacity"], sched
