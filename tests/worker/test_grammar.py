"""Worker rank 0's grammar runtime on the built-in vocabulary (one byte per token id): masks allow
exactly the continuations of the grammar, matchers follow the sampled tokens, a matcher out of step
is rebuilt from the request's history, and completion is reported once."""

from __future__ import annotations

import json

import pytest
import torch

from shared.config import builtin_model_dir
from shared.messages import GrammarSpec, SamplingParams
from shared.model_info import ModelInfo
from worker_proc.output.grammar import GrammarRuntime, vocab_of
from worker_proc.output.sampling import SampleRequest, sample

pytest.importorskip("xgrammar")

EOS = 256
REGEX = GrammarSpec(kind="regex", source="ab[0-9]")
SCHEMA = GrammarSpec(kind="json_schema", source=json.dumps(
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def runtime() -> GrammarRuntime:
    info = ModelInfo.from_dir(builtin_model_dir())
    return GrammarRuntime(builtin_model_dir(), info.vocab_size, info.eos_token_ids)


def _allowed(rt: GrammarRuntime, req: SampleRequest) -> set[int]:
    errors: dict[str, str] = {}
    apply = rt.constrain([req], errors)
    assert apply is not None and not errors
    logits = torch.zeros(1, rt.vocab_size)
    apply(logits)
    return {i for i in range(rt.vocab_size) if logits[0, i] > -1e30}


def _req(rid: str, spec: GrammarSpec, out: list[int], prompt: list[int] = (1, 2)) -> SampleRequest:  # type: ignore[assignment]
    return SampleRequest(rid, SamplingParams(temperature=0.0, grammar=spec), len(out), list(prompt) + out)


def test_vocab_is_byte_level() -> None:
    encoded, kind, _ = vocab_of(builtin_model_dir(), 260)
    assert kind == "BYTE_LEVEL" and encoded[ord("a")] == "a" and encoded[EOS] == "<|end_of_text|>"


def test_masks_follow_the_grammar_and_completion_is_reported(runtime: GrammarRuntime) -> None:
    out: list[int] = []
    steps = [{ord("a")}, {ord("b")}, set(range(ord("0"), ord("9") + 1)), {EOS}]
    for want, tok in zip(steps, [ord("a"), ord("b"), ord("7"), EOS], strict=True):
        r = _req("g", REGEX, out)
        assert _allowed(runtime, r) == want
        done = runtime.accept([r], [tok], {}, set())
        out.append(tok)
        assert done == (["g"] if tok == EOS else [])


def test_out_of_step_matcher_is_rebuilt_from_history(runtime: GrammarRuntime) -> None:
    # first seen mid-output (e.g. after another process's restart): replayed from the history
    assert _allowed(runtime, _req("late", REGEX, [ord("a")])) == {ord("b")}
    # the same rid now a new request (output_len 0): a fresh matcher
    assert _allowed(runtime, _req("late", REGEX, [])) == {ord("a")}
    # a different grammar under the same rid
    assert _allowed(runtime, _req("late", SCHEMA, [])) == {ord("{")}


def test_history_that_breaks_the_grammar_is_an_error(runtime: GrammarRuntime) -> None:
    errors: dict[str, str] = {}
    assert runtime.constrain([_req("bad", REGEX, [ord("z")])], errors) is None
    assert "structured output failed" in errors["bad"]


def test_sampling_under_a_schema_gives_valid_json(runtime: GrammarRuntime) -> None:
    gen = torch.Generator().manual_seed(0)
    out: list[int] = []
    params = SamplingParams(temperature=1.0, seed=4, grammar=SCHEMA)
    for _ in range(40):
        r = SampleRequest("j", params, len(out), [5] + out)
        errors: dict[str, str] = {}
        apply = runtime.constrain([r], errors)
        toks, _ = sample(torch.randn(1, runtime.vocab_size, generator=gen), [r], constrain=apply)
        done = runtime.accept([r], toks, errors, set())
        assert not errors
        out.append(toks[0])
        if done:
            break
    assert out[-1] == EOS
    assert json.loads(bytes(out[:-1]).decode()) in ({"ok": True}, {"ok": False})


def test_unconstrained_rows_are_untouched(runtime: GrammarRuntime) -> None:
    logits = torch.randn(2, runtime.vocab_size, generator=torch.Generator().manual_seed(1))
    reqs = [_req("c", REGEX, []), SampleRequest("free", SamplingParams(temperature=0.0), 0)]
    apply = runtime.constrain(reqs, {})
    toks, _ = sample(logits, reqs, constrain=apply)
    assert toks == [ord("a"), int(logits[1].argmax())]


def test_a_grammar_after_reasoning_waits_for_its_end(runtime: GrammarRuntime) -> None:
    """`after` (a reasoning model's `</think>`): the output is free until those tokens, then constrained."""
    end = tuple(ord(c) for c in "</think>")
    spec = GrammarSpec(kind="regex", source="ab[0-9]", after=end)
    out: list[int] = []
    for tok in [ord(c) for c in "zz<"] + list(end[1:]):
        r = _req("think", spec, out)
        assert runtime.constrain([r], {}) is None  # free text while thinking
        assert runtime.accept([r], [tok], {}, set()) == []
        out.append(tok)
    assert _allowed(runtime, _req("think", spec, out)) == {ord("a")}
    assert _allowed(runtime, _req("late-think", spec, out + [ord("a")])) == {ord("b")}  # rebuilt past `after`


def _masks(rt: GrammarRuntime, reqs: list[SampleRequest]) -> list[set[int]]:
    errors: dict[str, str] = {}
    apply = rt.constrain(reqs, errors)
    assert apply is not None and not errors
    logits = torch.zeros(len(reqs), rt.vocab_size)
    apply(logits)
    return [{i for i in range(rt.vocab_size) if logits[j, i] > -1e30} for j in range(len(reqs))]


def _verify(spec: GrammarSpec, out: list[int], drafts: list[int], rid: str = "v") -> list[SampleRequest]:
    """A verify slice's positions as the worker builds them: position k has the first k drafts."""
    return [_req(rid, spec, out + drafts[:k]) for k in range(len(drafts) + 1)]


def test_a_verify_slice_is_masked_position_by_position(runtime: GrammarRuntime) -> None:
    digits = set(range(ord("0"), ord("9") + 1))
    a, b, x = ord("a"), ord("b"), ord("x")
    assert _masks(runtime, _verify(REGEX, [], [a, b])) == [{a}, {b}, digits]
    free = _masks(runtime, _verify(REGEX, [], [a, x, b]))  # the grammar refuses the second draft
    assert free[:2] == [{a}, {b}] and len(free[2]) == len(free[3]) == runtime.vocab_size
    plain = _req("v", REGEX, [])
    assert _allowed(runtime, plain) == {a}  # the drafts tried for the masks were rolled back
    # a plain request beside a verify slice keeps its own row
    both = _masks(runtime, [_req("p", REGEX, [a]), *_verify(REGEX, [a], [b, ord("3")], rid="w")])
    assert both == [{b}, {b}, digits, {EOS}]
    assert runtime.accept(_verify(REGEX, [], [a, b]), [a, b, ord("5")], {}, set()) == []  # the emitted tokens
    assert runtime._matchers["v"].accepted == 3
    assert _allowed(runtime, _req("v", REGEX, [a, b, ord("5")])) == {EOS}


def test_an_ended_request_loses_its_matcher(runtime: GrammarRuntime) -> None:
    r = _req("ended", REGEX, [ord("a")])
    assert _allowed(runtime, r) == {ord("b")} and "ended" in runtime._matchers
    runtime.forget(["ended", "never-seen"])
    assert "ended" not in runtime._matchers
    assert _allowed(runtime, r) == {ord("b")}  # rebuilt from the history if the rid comes back
