"""Verifying drafted tokens in the worker (worker_proc/spec/verify.py): whatever the drafts, the
output is the one decoding without them would give, and the recurrent state after every step is the
state after exactly the accepted tokens (bitwise in the deterministic mode), for every family."""

from __future__ import annotations

import pytest
import torch

from shared.messages import SamplingParams
from tests.model_driver import generate_greedy, generate_speculative
from tests.worker.util import ALL_FIXTURES, GDN_FIXTURES, runner

PROMPT = [3, 17, 9, 4, 22, 8, 15, 2, 11, 30, 6, 19]


def _gdn_prompt() -> list[int]:
    return [(7 * i + 3) % 40 + 1 for i in range(70)]  # GDN fixtures want prompts over 64 tokens


def _oracle(reference: list[int], prompt_len: int, k: int):
    """Drafts that are right for a varying number of tokens, then wrong: the step that has produced
    n tokens proposes the next (n % (k + 1)) right tokens, then wrong ones up to k."""

    def propose(tokens: list[int]) -> list[int]:
        n = len(tokens) - prompt_len
        right = reference[n : n + n % (k + 1)]
        wrong = [(t + 1) % 50 + 1 for t in reference[n + len(right) : n + k]]
        return right + wrong

    return propose


def _states(r, slot: int) -> dict[str, torch.Tensor]:
    return {name: pool[:, slot].clone() for name, pool in r.pools.states.items()}


@pytest.mark.parametrize("name", ALL_FIXTURES + GDN_FIXTURES)
def test_any_drafts_give_the_greedy_output_and_its_state(name: str) -> None:
    prompt = _gdn_prompt() if name in GDN_FIXTURES else PROMPT
    ref_runner = runner(name, kv_slots=160, deterministic=True)
    ref = generate_greedy(ref_runner, prompt, 14)
    spec_runner = runner(name, kv_slots=160, deterministic=True)
    out, accepted = generate_speculative(spec_runner, prompt, 14, _oracle(ref, len(prompt), 4))
    assert out == ref
    assert sorted(set(accepted)) != [0] and 0 in accepted  # some steps accepted drafts, some rejected all
    # both runners processed prompt + ref[:-1]: their recurrent states are the same bits
    ref_states, spec_states = _states(ref_runner, 1), _states(spec_runner, 1)
    for key, value in ref_states.items():
        assert torch.equal(value, spec_states[key]), key
    spec_runner.check_integrity()


def test_seeded_sampling_draws_the_same_tokens_with_drafts() -> None:
    """A draw depends on (seed, output index) and the prefix only, so with drafts a sampled request
    gives the very tokens it gives without: the target distribution is kept, draw for draw."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    plain, _ = generate_speculative(runner("nope_groups2", kv_slots=160, deterministic=True), PROMPT, 16,
                                    lambda tokens: [], params)  # fmt: skip
    drafted, accepted = generate_speculative(runner("nope_groups2", kv_slots=160, deterministic=True), PROMPT, 16,
                                             _oracle(plain, len(PROMPT), 3), params)  # fmt: skip
    assert drafted == plain and any(accepted)


def test_logprobs_come_for_every_token_a_verify_step_emits() -> None:
    """The logprob and top logprobs of each emitted token, accepted draft or not, are those decoding
    without drafts gives (bit for bit in the deterministic mode, where a verify position runs as a
    decode step)."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, logprobs=True, top_logprobs=2)
    plain_lps: list = []
    plain, _ = generate_speculative(runner("nope_groups2", kv_slots=160, deterministic=True), PROMPT, 16,
                                    lambda tokens: [], params, plain_lps)  # fmt: skip
    drafted_lps: list = []
    drafted, accepted = generate_speculative(runner("nope_groups2", kv_slots=160, deterministic=True), PROMPT, 16,
                                             _oracle(plain, len(PROMPT), 3), params, drafted_lps)  # fmt: skip
    assert drafted == plain and sum(accepted) >= 4
    assert len(drafted_lps) == len(plain_lps) >= 16 and drafted_lps == plain_lps
    assert all(lp <= 0.0 and len(top) == 2 and top[0][1] >= top[1][1] for lp, top in drafted_lps)


def test_default_mode_accepts_what_greedy_decoding_gives() -> None:
    ref = generate_greedy(runner("rope_moe", kv_slots=160), PROMPT, 12)
    out, accepted = generate_speculative(runner("rope_moe", kv_slots=160), PROMPT, 12, _oracle(ref, len(PROMPT), 4))
    assert out == ref and any(accepted)


def test_a_drafted_stop_token_ends_the_accepted_run() -> None:
    """A stop token drafted and drawn is emitted as the token after the accepted drafts, never
    accepted as a draft (nothing may follow it)."""
    ref = generate_greedy(runner("nope_groups2", kv_slots=160, deterministic=True), PROMPT, 8)
    stop = ref[3]
    params = SamplingParams(temperature=0.0, stop_token_ids=[stop])
    r = runner("nope_groups2", kv_slots=160, deterministic=True)
    out, accepted = generate_speculative(r, PROMPT, 8, lambda tokens: ref[len(tokens) - len(PROMPT):][:5], params)
    first = out.index(stop)
    assert out[: first + 1] == ref[: first + 1]
    assert accepted[0] == first - 1  # the first verify step stopped accepting right before the stop


def test_sampled_tokens_keep_the_target_distribution() -> None:
    """Over many seeds, the first token a verify step emits (its draft when accepted, else the draw
    that rejected it) follows the model's own distribution, and so does the token after an accepted
    draft: a chi-square test per position against the probabilities of the logits."""
    from shared.messages import ForwardBatch, ReqSlice
    from tests.model_driver import forward_all_logits
    from tests.worker.util import batch, req

    r = runner("nope_groups2", kv_slots=160, deterministic=True)
    n = len(PROMPT)
    logits = forward_all_logits(r, batch(0, [req("p", PROMPT, 0, list(range(1, n + 1)), 1)], clears=[1]))["p"]
    temp = 0.25  # sharp enough that the likeliest token is drafted and often accepted
    target0 = torch.softmax(logits[-1].double() / temp, -1)
    draft = int(target0.argmax())
    logits1 = forward_all_logits(r, batch(1, [req("q", PROMPT + [draft], 0, list(range(1, n + 2)), 1)], clears=[1]))
    target1 = torch.softmax(logits1["q"][-1].double() / temp, -1)
    first, second = [], []
    for seed in range(600):
        params = SamplingParams(temperature=temp, seed=seed)
        step = 2 + 2 * seed
        r.step(ForwardBatch(step=step, clears=[1], reqs=[ReqSlice(
            rid="s", input_ids=PROMPT[:-1], start_pos=0, kv_slots=list(range(1, n)), state_slot=1, sample=False)]))
        res = r.step(ForwardBatch(step=step + 1, reqs=[ReqSlice(
            rid="s", input_ids=[PROMPT[-1], draft], start_pos=n - 1, kv_slots=list(range(1, n + 2)), state_slot=1,
            sample=True, sampling=params, drafts=1, backup_slot=2)]))  # fmt: skip
        if res.accepted["s"]:
            first.append(draft)
            second.append(res.next_tokens["s"])
        else:
            first.append(res.next_tokens["s"])
    assert 0.1 < len(second) / len(first) < 0.95  # the draft is accepted about target0[draft] of the time
    for drawn, target in ((first, target0), (second, target1)):
        counts = torch.bincount(torch.tensor(drawn), minlength=target.numel()).double()
        expected = target * len(drawn)
        big = expected >= 5  # chi-square over the likely tokens, the rest pooled
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        keep = exp > 0
        chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        dof = int(keep.sum()) - 1
        assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (chi2, dof)  # far beyond any plausible fluctuation


def test_drafts_under_a_grammar_give_the_constrained_output() -> None:
    """A request with structured output takes drafts: each position is masked as the grammar stands
    after the drafts before it, so drafts the grammar refuses are rejected and the output is the
    constrained greedy output without drafts."""
    from shared.config import builtin_model_dir
    from shared.messages import GrammarSpec
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    def fresh() -> ModelRunner:
        return ModelRunner(builtin_model_dir(),
            WorkerConfig(device="cpu", dtype="float32", kv_slots=256, state_slots=4, deterministic=True))

    params = SamplingParams(temperature=0.0, grammar=GrammarSpec(kind="regex", source="[a-c]{4}-[0-9]{3}"))
    prompt = list(b"Code: ")
    ref, _ = generate_speculative(fresh(), prompt, 30, lambda tokens: [], params)
    assert len(ref) == 9 and bytes(ref[:4]).isalpha() and ref[4] == ord("-")
    wrong = [ord("z"), ord("-"), ord("9")]  # bytes the grammar refuses where they are drafted

    def propose(tokens: list[int]) -> list[int]:
        n = len(tokens) - len(prompt)
        return ref[n : n + n % 3] + wrong[: 3 - n % 3]

    out, accepted = generate_speculative(fresh(), prompt, 30, propose, params)
    assert out == ref and any(accepted) and 0 in accepted
