"""Drafting with a checkpoint's MTP layers (worker_proc/spec/mtp_drafting.py, --speculative-algorithm NEXTN):
the guesses after every step are the ones transformers' own layers give when run as the MTP layers
over the whole sequence (Qwen3-Next's MTP layer; Nemotron-H's MTP step, an attention and a MoE
block), through chunked prefill, decode and verify steps that accept some drafts and reject others;
the output stays the greedy one."""

from __future__ import annotations

import pytest

from shared.errors import ModelLoadError
from shared.messages import ForwardBatch, ReqSlice, SamplingParams
from tests.model_driver import generate_greedy
from tests.mtp_checkpoint import ReferenceMtp, ReferenceNemotronMtp, write_mtp_checkpoint, write_nemotron_mtp_checkpoint
from tests.worker.util import fixture_dir
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [(7 * i + 3) % 40 + 1 for i in range(70)]  # GDN fixtures want prompts over 64 tokens
K = 3


FAMILIES = {
    "qwen3_next": (write_mtp_checkpoint, ReferenceMtp),
    "nemotron_h": (write_nemotron_mtp_checkpoint, ReferenceNemotronMtp),
}


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_mtp_checkpoint(str(tmp_path_factory.mktemp("mtp")))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_mtp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, type]:
    """(checkpoint directory, reference MTP class) of each family with MTP layers."""
    write, reference = FAMILIES[request.param]
    return write(str(tmp_path_factory.mktemp(request.param))), reference


def _slice(ids: list[int], start: int, sample: bool = True, **kw: object) -> ReqSlice:
    return ReqSlice(rid="a", input_ids=ids, start_pos=start, kv_slots=list(range(1, start + len(ids) + 1)),
                    state_slot=1, sample=sample, sampling=GREEDY if sample else None, **kw)  # fmt: skip


def test_guesses_follow_the_reference_mtp_through_chunks_decodes_and_verifies(family_mtp: tuple[str, type]) -> None:
    mtp_dir, reference = family_mtp
    ref = reference(mtp_dir)
    greedy = generate_greedy(ModelRunner(mtp_dir, WorkerConfig(kv_slots=200, state_slots=8)), PROMPT, 12)
    r = ModelRunner(mtp_dir, WorkerConfig(kv_slots=200, state_slots=8, speculative_algorithm="NEXTN"))
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
        res = r.step(
            ForwardBatch(
                step=step,
                reqs=[
                    _slice(
                        [out[-1], *drafts], start, drafts=len(drafts), backup_slot=2, draft_next=K, output_len=len(out)
                    )
                ],
            )
        )
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
    r = ModelRunner(mtp_dir, WorkerConfig(kv_slots=200, state_slots=8, speculative_algorithm="NEXTN"))
    res = r.step(ForwardBatch(step=0, reqs=[_slice(PROMPT, 0)], clears=[1]))
    out = [res.next_tokens["a"]]
    for step in range(1, 4):
        res = r.step(ForwardBatch(step=step, reqs=[_slice([out[-1]], len(PROMPT) + len(out) - 1, output_len=len(out),
                                                         draft_next=K if step == 3 else 0)]))  # fmt: skip
        out.append(res.next_tokens["a"])
    assert res.drafts["a"] == ref.guesses(PROMPT + out, K)


def test_a_checkpoint_without_mtp_layers_cannot_draft_with_them() -> None:
    with pytest.raises(ModelLoadError, match="no MTP layers"):
        ModelRunner(
            fixture_dir("qwen3_next_moe"), WorkerConfig(kv_slots=96, state_slots=4, speculative_algorithm="NEXTN")
        )


def test_without_nextn_the_mtp_tensors_are_skipped_and_guesses_refused(mtp_dir: str) -> None:
    r = ModelRunner(mtp_dir, WorkerConfig(kv_slots=96, state_slots=4))
    assert r.model.mtp is None and r.drafter is None
    with pytest.raises(ValueError, match="no MTP layers"):
        r.step(ForwardBatch(step=0, reqs=[_slice(PROMPT, 0, draft_next=2)], clears=[1]))


def test_a_nemotron_checkpoint_with_two_mtp_steps_drafts_with_the_first(tmp_path, caplog) -> None:
    """Every guess runs the first MTP step; the second step's tensors are skipped, with one log line."""
    path = write_nemotron_mtp_checkpoint(str(tmp_path / "two_steps"), steps=2)
    with caplog.at_level("INFO", logger="worker_proc.loading.weight_files"):
        r = ModelRunner(path, WorkerConfig(kv_slots=200, state_slots=8, speculative_algorithm="NEXTN"))
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", "pt") as f:
        second = [k for k in f.keys() if k.startswith(("mtp.layers.2.", "mtp.layers.3."))]
    skipped = [m.message for m in caplog.records if "not loaded" in m.message]
    assert skipped == [f"{len(second)} checkpoint tensors under mtp_unused. not loaded (not used for serving)"]
    res = r.step(ForwardBatch(step=0, reqs=[_slice(PROMPT, 0, draft_next=K)], clears=[1]))
    assert res.drafts["a"] == ReferenceNemotronMtp(path).guesses(PROMPT + [res.next_tokens["a"]], K)


def test_nemotron_mtp_layer_spellings_and_bad_layouts() -> None:
    from shared.families.registry import parse_config
    from shared.model_info import read_config_json

    cfg = dict(read_config_json(fixture_dir("nemotron_h_moe")), num_nextn_predict_layers=1)
    by_list = parse_config(cfg)
    assert [b.kind for sub in by_list.mtp_spec for b in sub.blocks] == ["attention", "sigmoid_moe"]
    legacy = dict(cfg, mtp_hybrid_override_pattern="*E")
    del legacy["mtp_layers_block_type"]
    assert parse_config(legacy) == by_list
    assert parse_config(dict(cfg, num_nextn_predict_layers=0)).mtp_layers == 0
    with pytest.raises(ModelLoadError, match="exactly one attention"):
        parse_config(dict(cfg, mtp_layers_block_type=["attention", "attention", "moe"]))
    with pytest.raises(ModelLoadError, match="mtp_layers_block_type 'mamba'"):
        parse_config(dict(cfg, mtp_layers_block_type=["attention", "mamba"]))
