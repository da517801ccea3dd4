"""Rank 0's diagnosis of a token the grammar refuses (worker_proc/output/grammar.py `accept`, `dead_end`), on
the built-in vocabulary (one byte per token id): a constraint that leaves no token the request may
sample (nothing allowed, or only the stop tokens while min_tokens blocks them) is the client's fault
(`rejected`, with a message naming the problem); a refused token the mask allowed is an internal
failure; plain and verify slices alike."""

from __future__ import annotations

import pytest
import torch

from shared.config import builtin_model_dir
from shared.messages import GrammarSpec, SamplingParams
from shared.model_info import ModelInfo
from worker_proc.output.grammar import GrammarRuntime
from worker_proc.output.sampling import SampleRequest, sample
from worker_proc.spec import verify as speculative

pytest.importorskip("xgrammar")

EOS = 256
NOTHING = GrammarSpec(kind="regex", source=r"[^\s\S]")  # no string matches it
A_THEN_NOTHING = GrammarSpec(kind="regex", source=r"(a|b)[^\s\S]")  # empty, but "a" and "b" may start it
A_FORCED = GrammarSpec(kind="regex", source=r"a[^\s\S]")
AB = GrammarSpec(kind="regex", source="ab")


@pytest.fixture(scope="module")
def runtime() -> GrammarRuntime:
    info = ModelInfo.from_dir(builtin_model_dir())
    return GrammarRuntime(builtin_model_dir(), info.vocab_size, info.eos_token_ids)


def _req(rid: str, spec: GrammarSpec, out: list[int], temperature: float = 0.0, **kw: int) -> SampleRequest:
    params = SamplingParams(temperature=temperature, seed=3, grammar=spec, **kw)
    return SampleRequest(rid, params, len(out), [1, 2, *out])


def _step(rt: GrammarRuntime, reqs: list[SampleRequest], starts: dict[int, int] | None = None,
          ) -> tuple[list[int], dict[str, str], set[str], list[str]]:  # fmt: skip
    """One sampling step as rank 0 runs it: mask, sample (with min_tokens), accept the emitted tokens.
    A verify slice (`starts`: its first row -> its drafts) keeps the drafts the draws agree with."""
    errors: dict[str, str] = {}
    rejected: set[str] = set()
    apply = rt.constrain(reqs, errors)
    logits = torch.randn(len(reqs), rt.vocab_size, generator=torch.Generator().manual_seed(0))
    tokens, _ = sample(logits, reqs, eos_ids=(EOS,), constrain=apply)
    accepted = {}
    for first, n in (starts or {}).items():
        guesses = [(reqs[first + k].history or [])[-1] for k in range(1, n + 1)]
        accepted[reqs[first].rid] = next((k for k in range(n) if tokens[first + k] != guesses[k]), n)
    done = rt.accept(*speculative.emitted(reqs, tokens, starts or {}, accepted), errors, rejected)
    return tokens, errors, rejected, done


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constraint_nothing_satisfies_is_rejected_from_the_first_token(runtime: GrammarRuntime,
                                                                         temperature: float) -> None:
    _, errors, rejected, done = _step(runtime, [_req("none", NOTHING, [], temperature)])
    assert rejected == {"none"} and done == []
    assert errors["none"] == ("structured output: no token can continue the output under the constraint after "
                              "0 tokens (no text satisfies it)")
    assert "none" not in runtime._matchers


def test_a_dead_end_after_some_output_names_its_length(runtime: GrammarRuntime) -> None:
    toks, errors, rejected, _ = _step(runtime, [_req("late", A_THEN_NOTHING, [])])
    assert toks[0] in (ord("a"), ord("b")) and not errors and not rejected
    _, errors, rejected, _ = _step(runtime, [_req("late", A_THEN_NOTHING, toks)])
    assert rejected == {"late"} and "after 1 token (no text satisfies it)" in errors["late"]


def test_min_tokens_beyond_a_complete_constraint_is_rejected(runtime: GrammarRuntime) -> None:
    out = [ord("a"), ord("b")]
    _, errors, rejected, _ = _step(runtime, [_req("min", AB, out, min_tokens=5)])
    assert rejected == {"min"}
    assert errors["min"] == "min_tokens 5 cannot be met: the constraint is complete after 2 tokens"
    # min_tokens met by then, or ignoring only EOS it does not block: the grammar simply completes
    for kw in ({"min_tokens": 2}, {}):
        toks, errors, rejected, done = _step(runtime, [_req("min-ok", AB, out, **kw)])
        assert toks == [EOS] and done == ["min-ok"] and not errors and not rejected


def test_a_stop_token_min_tokens_masked_is_rejected_too(runtime: GrammarRuntime) -> None:
    """A row with nothing left is all -inf, and its draw is token 0: where that is the model's stop
    token the grammar accepts it, yet min_tokens masked it, so the request is still rejected."""
    r = _req("stop0", AB, [ord("a"), ord("b")], min_tokens=5)
    errors: dict[str, str] = {}
    rejected: set[str] = set()
    assert runtime.constrain([r], errors) is not None
    assert runtime.accept([r], [EOS], errors, rejected) == []  # as drawn from a row of -inf
    assert rejected == {"stop0"} and "min_tokens 5 cannot be met" in errors["stop0"]


def test_a_refused_token_the_mask_allowed_is_an_internal_failure(runtime: GrammarRuntime) -> None:
    r = _req("broken", AB, [])
    errors: dict[str, str] = {}
    rejected: set[str] = set()
    assert runtime.constrain([r], errors) is not None and not errors
    runtime.accept([r], [ord("z")], errors, rejected)  # as if the mask had not been applied
    assert not rejected and errors["broken"].startswith("structured output failed: sampled token 122")
    # a matcher lost between masking and accepting cannot be diagnosed: internal too
    r = _req("lost", NOTHING, [])
    runtime.constrain([r], errors)
    runtime.forget(["lost"])
    runtime.accept([r], [0], errors, rejected)
    assert not rejected and errors["lost"].startswith("structured output failed")


def test_a_verify_slice_that_reaches_the_dead_end_is_rejected(runtime: GrammarRuntime) -> None:
    """Drafts "a", "x": position 0 allows only "a", position 1 (after "a") nothing. The draw at
    position 1 is refused with the matcher standing after the accepted draft."""
    drafts = [ord("a"), ord("x")]
    reqs = [_req("v", A_FORCED, drafts[:k]) for k in range(len(drafts) + 1)]
    toks, errors, rejected, _ = _step(runtime, reqs, starts={0: 2})
    assert toks[0] == ord("a")
    assert rejected == {"v"} and "after 1 token (no text satisfies it)" in errors["v"]


def test_a_rejected_request_leaves_its_neighbours_alone(runtime: GrammarRuntime) -> None:
    reqs = [_req("dead", NOTHING, []), _req("fine", AB, [ord("a")]),
            SampleRequest("free", SamplingParams(temperature=0.0), 0)]
    toks, errors, rejected, _ = _step(runtime, reqs)
    assert rejected == {"dead"} and set(errors) == {"dead"} and toks[1] == ord("b")
