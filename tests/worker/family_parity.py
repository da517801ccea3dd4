"""Parity checks of ModelRunner against a family checkpoint's transformers reference (written by
tests/fixtures/family_checkpoint.py: `reference.safetensors` beside the weights), through msgpack
round-tripped batches: all-position prompt logits, chunked prefill, per-step decode logits and greedy
tokens, a prefix hit (the cached state copied on write) against the uninterrupted prompt, and drafts
verified with the recurrent state rolled back to the accepted tokens.

Each check takes the checkpoint's directory, the family's logit tolerance and, where the state is
compared, the names of the family's state pools (`ModelRunner.pools.states`); it returns the runner
it checked for the family's own assertions on its pools."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from shared.messages import CopyOp
from tests.model_driver import forward_all_logits, forward_logits, generate_greedy, generate_speculative
from tests.worker.util import batch, chunked_prompt_logits, decode_logit_diffs, max_diff, req, runner_at
from worker_proc.runtime.runner import ModelRunner

KV_SLOTS = 200
DRAFT_STEPS = 14


def family_reference(model_dir: str) -> dict[str, torch.Tensor]:
    """The transformers reference beside the checkpoint: `prompt`, `prompt_logits`, `gen_tokens`, `gen_logits`."""
    return load_file(os.path.join(model_dir, "reference.safetensors"))


def family_runner(model_dir: str, deterministic: bool = False, **kw: object) -> ModelRunner:
    """A runner of the checkpoint with KV_SLOTS token slots (the prompt and its decode fit at scattered slots)."""
    return runner_at(model_dir, kv_slots=KV_SLOTS, deterministic=deterministic, **kw)


def check_full_prompt_logits(model_dir: str, deterministic: bool, tol: float) -> ModelRunner:
    """The whole reference prompt in one step into state slot 1 (KV slots 1..n): every row's logits within
    `tol` of transformers'; the pools stay consistent."""
    ref = family_reference(model_dir)
    r = family_runner(model_dir, deterministic)
    prompt = ref["prompt"].tolist()
    n = len(prompt)
    out = forward_all_logits(r, batch(0, [req("a", prompt, 0, list(range(1, n + 1)), 1)], clears=[1]))
    assert max_diff(out["a"], ref["prompt_logits"]) <= tol
    r.check_integrity()
    return r


def check_chunked_prefill_logits(model_dir: str, chunks: list[int], deterministic: bool, tol: float) -> None:
    """The reference prompt prefilled in `chunks` (which must sum to its length), each resuming from the
    pooled state: every row's logits within `tol` of transformers'."""
    ref = family_reference(model_dir)
    prompt = ref["prompt"].tolist()
    assert sum(chunks) == len(prompt)
    r = family_runner(model_dir, deterministic)
    assert max_diff(chunked_prompt_logits(r, prompt, chunks), ref["prompt_logits"]) <= tol
    r.check_integrity()


def check_decode_logits_and_greedy_tokens(model_dir: str, deterministic: bool, tol: float) -> None:
    """Each decode step fed the reference's previous token gives logits within `tol` of transformers';
    greedy generation through `step` gives the reference's tokens."""
    ref = family_reference(model_dir)
    prompt, gen = ref["prompt"].tolist(), ref["gen_tokens"].tolist()
    r = family_runner(model_dir, deterministic)
    diffs = decode_logit_diffs(r, prompt, gen, ref["gen_logits"])
    assert len(diffs) == len(gen) and max(diffs) <= tol, diffs
    r.check_integrity()
    assert generate_greedy(r, prompt, len(gen)) == gen


def check_prefix_hit_copy_on_write(model_dir: str, pools: tuple[str, ...], tol: float) -> ModelRunner:
    """A cached prefix's state (slot 1, the prompt's first 9 tokens) copied on write into a new request's
    slot 2 resumes as the uninterrupted prompt (slot 4) within `tol`; each of `pools` is left as it was in
    the source slot and, in slot 2, holds the uninterrupted prompt's state within `tol`."""
    prompt = family_reference(model_dir)["prompt"].tolist()
    n, cut = len(prompt), 9
    r = family_runner(model_dir)
    kv = list(range(1, n + 1))
    whole = forward_all_logits(r, batch(0, [req("x", prompt, 0, list(range(100, 100 + n)), 4)], clears=[4]))["x"]
    forward_logits(r, batch(1, [req("p", prompt[:cut], 0, kv[:cut], 1, sample=False)], clears=[1]))
    source = {k: r.pools.states[k][:, 1].clone() for k in pools}
    rest = forward_all_logits(r, batch(2, [req("y", prompt[cut:], cut, kv, 2)],
                                       copies=[CopyOp(src=1, dst=2, rid="y")]))["y"]  # fmt: skip
    assert max_diff(rest, whole[cut:]) <= tol
    for k in pools:
        pool = r.pools.states[k]
        assert torch.equal(pool[:, 1], source[k]), k
        assert max_diff(pool[:, 2], pool[:, 4]) <= tol and not torch.equal(pool[:, 2], source[k]), k
    r.check_integrity()
    return r


def check_drafts_roll_back_the_state(model_dir: str, pools: tuple[str, ...]) -> None:
    """Drafts right for a varying number of tokens, then wrong, over DRAFT_STEPS tokens in the deterministic
    mode: the output is greedy decoding's, some drafts are accepted and some refused, and each of `pools`
    ends bitwise as greedy decoding leaves it (the state of exactly the accepted tokens)."""
    prompt = family_reference(model_dir)["prompt"].tolist()
    plain = family_runner(model_dir, True)
    ref = generate_greedy(plain, prompt, DRAFT_STEPS)

    def propose(tokens: list[int]) -> list[int]:
        done = len(tokens) - len(prompt)
        right = ref[done : done + done % 3]
        return right + [(t + 1) % 250 + 3 for t in ref[done + len(right) : done + 3]]

    drafted = family_runner(model_dir, True)
    out, accepted = generate_speculative(drafted, prompt, DRAFT_STEPS, propose)
    assert out == ref
    assert 0 in accepted and max(accepted) > 0
    for k in pools:
        assert torch.equal(plain.pools.states[k][:, 1], drafted.pools.states[k][:, 1]), k
    drafted.check_integrity()
