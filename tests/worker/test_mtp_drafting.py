"""Drafting with a checkpoint's MTP layers (worker_proc/mtp_drafting.py, --speculative-algorithm NEXTN):
the guesses after every step are the ones transformers' Qwen3-Next decoder layer gives when run as the
MTP layer over the whole sequence, through chunked prefill, decode and verify steps that accept some
drafts and reject others; the output stays the greedy one."""

from __future__ import annotations

import pytest

from shared.errors import ModelLoadError
from shared.messages import ForwardBatch, ReqSlice, SamplingParams
from tests.model_driver import generate_greedy
from tests.mtp_checkpoint import ReferenceMtp, write_mtp_checkpoint
from tests.worker.util import fixture_dir
from worker_proc.runtime import ModelRunner

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [(7 * i + 3) % 40 + 1 for i in range(70)]  # GDN fixtures want prompts over 64 tokens
K = 3


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_mtp_checkpoint(str(tmp_path_factory.mktemp("mtp")))


def _slice(ids: list[int], start: int, sample: bool = True, **kw: object) -> ReqSlice:
    return ReqSlice(rid="a", input_ids=ids, start_pos=start, kv_slots=list(range(1, start + len(ids) + 1)),
                    state_slot=1, sample=sample, sampling=GREEDY if sample else None, **kw)  # fmt: skip


def test_guesses_follow_the_reference_mtp_through_chunks_decodes_and_verifies(mtp_dir: str) -> None:
    ref = ReferenceMtp(mtp_dir)
    greedy = generate_greedy(ModelRunner(mtp_dir, kv_slots=200, state_slots=8), PROMPT, 12)
    r = ModelRunner(mtp_dir, kv_slots=200, state_slots=8, speculative_algorithm="NEXTN")
    first = _slice(PROMPT[:40], 0, sample=False, prompt_next=PROMPT[40])
    r.step(ForwardBatch(step=0, reqs=[first], clears=[1]))
    res = r.step(ForwardBatch(step=1, reqs=[_slice(PROMPT[40:], 40, draft_next=K, output_len=0)]))
    out = [res.next_tokens["a"]]
    guesses = res.drafts["a"]
    assert guesses == ref.guesses(PROMPT + out, K)
    step, verified = 2, []
    while len(out) < len(greedy) - K - 1:
        right = step % (K + 1)  # steps whose drafts are right for 0..K tokens, then the MTP's own guesses
        drafts = greedy[len(out) : len(out) + right] + guesses[right:] if right else guesses
        start = len(PROMPT) + len(out) - 1
        res = r.step(ForwardBatch(step=step, reqs=[
            _slice([out[-1], *drafts], start, drafts=len(drafts), backup_slot=2, draft_next=K, output_len=len(out))]))
        n_ok = res.accepted["a"]
        verified.append(n_ok)
        out += drafts[:n_ok] + [res.next_tokens["a"]]
        assert out == greedy[: len(out)]
        guesses = res.drafts["a"]
        assert guesses == ref.guesses(PROMPT + out, K), (step, n_ok)
        step += 1
    assert max(verified) > 0 and min(verified) < K  # some drafts accepted, some rejected
    r.check_integrity()


def test_plain_decode_steps_keep_the_mtp_kv(mtp_dir: str) -> None:
    """Steps that verify nothing still run the MTP layers over their rows, so a later guess sees them."""
    ref = ReferenceMtp(mtp_dir)
    r = ModelRunner(mtp_dir, kv_slots=200, state_slots=8, speculative_algorithm="NEXTN")
    res = r.step(ForwardBatch(step=0, reqs=[_slice(PROMPT, 0)], clears=[1]))
    out = [res.next_tokens["a"]]
    for step in range(1, 4):
        res = r.step(ForwardBatch(step=step, reqs=[_slice([out[-1]], len(PROMPT) + len(out) - 1, output_len=len(out),
                                                         draft_next=K if step == 3 else 0)]))  # fmt: skip
        out.append(res.next_tokens["a"])
    assert res.drafts["a"] == ref.guesses(PROMPT + out, K)


def test_a_checkpoint_without_mtp_layers_cannot_draft_with_them() -> None:
    with pytest.raises(ModelLoadError, match="no MTP layers"):
        ModelRunner(fixture_dir("qwen3_next_moe"), kv_slots=96, state_slots=4, speculative_algorithm="NEXTN")


def test_without_nextn_the_mtp_tensors_are_skipped_and_guesses_refused(mtp_dir: str) -> None:
    r = ModelRunner(mtp_dir, kv_slots=96, state_slots=4)
    assert r.model.mtp is None and r.drafter is None
    with pytest.raises(ValueError, match="no MTP layers"):
        r.step(ForwardBatch(step=0, reqs=[_slice(PROMPT, 0, draft_next=2)], clears=[1]))
