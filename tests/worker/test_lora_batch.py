"""Adapters in mixed batches (deterministic mode): slices of the base model and of two adapters in one step,
prefill and decode, each equal bit for bit to the same request run alone; the base rows untouched by the
adapters; a slot's adapter replaced by a later `LoraLoad`; the runner's refusals (a slot without an adapter,
a slot beyond --max-loras-per-batch, adapter loads with LoRA off, an adapter whose files changed)."""

from __future__ import annotations

import shutil

import pytest
import torch

from shared.lora import LoraError
from shared.messages import LoraLoad, ReqSlice
from tests.model_driver import forward_all_logits, forward_logits
from tests.worker.lora_util import adapter_of, lora_batch, make_adapter
from tests.worker.util import GREEDY, fixture_dir, reference, runner

STEPS = 3
FAMILY_TARGETS = {  # (targets, rank) of two adapters per family
    "falcon_h1": ((["q_proj", "v_proj", "o_proj", "in_proj", "gate_proj", "down_proj"], 4), (["k_proj", "up_proj"], 8)),
    "qwen3_5_dense": ((["in_proj_qkv", "in_proj_b", "out_proj", "o_proj", "down_proj"], 4),
                      (["in_proj_z", "in_proj_a", "q_proj", "up_proj"], 8)),
    # rank 1 and a one-output layer: products onto one column
    "qwen3_5_moe": ((["shared_expert_gate", "in_proj_qkv", "o_proj"], 1), (["shared_expert.up_proj", "in_proj_b"], 3)),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("mixed")
    out = {}
    for name, ((first, r1), (second, r2)) in FAMILY_TARGETS.items():
        out[name] = (make_adapter(fixture_dir(name), str(root / f"{name}_1"), first, r=r1, seed=7),
                     make_adapter(fixture_dir(name), str(root / f"{name}_2"), second, r=r2, seed=8, rslora=True))
    return out


def _slice(rid: str, ids: list[int], start: int, kv: list[int], state: int, slot: int, out: int = 0) -> ReqSlice:
    return ReqSlice(rid=rid, input_ids=ids, start_pos=start, kv_slots=kv, state_slot=state, sample=True,
                    sampling=GREEDY, output_len=out, lora_slot=slot)


def _serve(r: object, reqs: dict[str, tuple[list[int], int]], loads: list[LoraLoad]) -> dict[str, list[torch.Tensor]]:
    """Every request of `reqs` (rid -> (prompt, adapter slot)) in the same steps: one prefill step (every row's
    logits), then STEPS decode steps; each request's logits per step."""
    kv, states, at = {}, {}, 1
    for i, (rid, (prompt, _)) in enumerate(reqs.items()):
        kv[rid], states[rid] = list(range(at, at + len(prompt) + STEPS)), i + 1
        at += len(prompt) + STEPS
    first = [_slice(rid, p, 0, kv[rid][: len(p)], states[rid], slot) for rid, (p, slot) in reqs.items()]
    out = {rid: [x] for rid, x in forward_all_logits(r, lora_batch(0, first, loads, list(states.values()))).items()}
    for step in range(1, STEPS + 1):
        slices = []
        for rid, (p, slot) in reqs.items():
            pos = len(p) + step - 1
            slices.append(_slice(rid, [int(out[rid][-1][-1].argmax())], pos, kv[rid][: pos + 1], states[rid], slot,
                                 step))
        for rid, x in forward_logits(r, lora_batch(step, slices)).items():
            out[rid].append(x[None])
    return out


@pytest.mark.parametrize("name", list(FAMILY_TARGETS))
def test_a_mixed_batch_equals_each_request_alone(name: str, pairs: dict[str, tuple[str, str]]) -> None:
    one, two = (adapter_of(name, d) for d in pairs[name])
    loads = [LoraLoad(slot=1, adapter=one), LoraLoad(slot=3, adapter=two)]
    prompt = reference(name)["prompt"].tolist()
    reqs = {"x": (prompt[:17], 1), "base": (prompt[3:20], 0), "y": (prompt[:11], 3), "x2": (prompt[5:9], 1),
            "base2": (prompt[1:6], 0)}  # slot 1's rows in two runs (x, x2): gathered by index
    mixed = _serve(runner(name, kv_slots=256, max_loras=3, deterministic=True), reqs, loads)
    alone_runner = runner(name, kv_slots=256, max_loras=3, deterministic=True)
    base_runner = runner(name, kv_slots=256, deterministic=True)  # LoRA off
    for rid, spec in reqs.items():
        alone = _serve(alone_runner, {rid: spec}, loads)[rid]
        assert all(torch.equal(a, b) for a, b in zip(mixed[rid], alone, strict=True)), rid
        if spec[1] == 0:
            plain = _serve(base_runner, {rid: spec}, [])[rid]
            assert all(torch.equal(a, b) for a, b in zip(mixed[rid], plain, strict=True)), rid
    assert (mixed["x"][0] - _serve(base_runner, {"x": (prompt[:17], 0)}, [])["x"][0]).abs().max() > 0.05
    alone_runner.check_integrity()


def test_a_later_load_replaces_the_slots_adapter(pairs: dict[str, tuple[str, str]]) -> None:
    name = "falcon_h1"
    one, two = (adapter_of(name, d) for d in pairs[name])
    prompt = reference(name)["prompt"].tolist()[:9]
    r = runner(name, kv_slots=256, max_loras=2, deterministic=True)
    first = _serve(r, {"a": (prompt, 1)}, [LoraLoad(slot=1, adapter=one), LoraLoad(slot=2, adapter=two)])["a"]
    under_two = _serve(r, {"a": (prompt, 2)}, [])["a"]
    replaced = _serve(r, {"a": (prompt, 1)}, [LoraLoad(slot=1, adapter=two)])["a"]
    assert not torch.equal(first[0], under_two[0])
    assert all(torch.equal(a, b) for a, b in zip(replaced, under_two, strict=True))  # nothing of `one` is left
    assert r.loras is not None and r.loras.adapters[1].uid == two.uid
    r.check_integrity()


def test_the_runner_refuses_slots_without_an_adapter(pairs: dict[str, tuple[str, str]], tmp_path) -> None:
    name = "falcon_h1"
    one = adapter_of(name, pairs[name][0])
    prompt = reference(name)["prompt"].tolist()[:5]
    r = runner(name, max_loras=2, deterministic=True)
    with pytest.raises(ValueError, match="adapter slot 2 holds no adapter"):
        _serve(r, {"a": (prompt, 2)}, [LoraLoad(slot=1, adapter=one)])
    assert r.loras is not None and not r.loras.adapters  # the failed step loaded nothing
    with pytest.raises(ValueError, match=r"adapter slot 3 outside 1\.\.2"):
        _serve(r, {"a": (prompt, 3)}, [LoraLoad(slot=3, adapter=one)])
    with pytest.raises(ValueError, match="serves no adapters"):
        _serve(runner(name, deterministic=True), {"a": (prompt, 1)}, [LoraLoad(slot=1, adapter=one)])
    with pytest.raises(ValueError, match="adapter slot 1 holds no adapter"):
        _serve(runner(name, deterministic=True), {"a": (prompt, 1)}, [])
    moved = shutil.copytree(pairs[name][0], tmp_path / "changed")
    changed = adapter_of(name, str(moved))
    shutil.copy(f"{pairs[name][1]}/adapter_model.safetensors", moved / "adapter_model.safetensors")
    with pytest.raises(LoraError):  # another adapter's files under the registered uid
        _serve(r, {"a": (prompt, 1)}, [LoraLoad(slot=1, adapter=changed)])
    assert not r.loras.adapters


def test_decode_steps_under_adapters_are_replayed_and_equal_the_steps_as_written(
        pairs: dict[str, tuple[str, str]]) -> None:  # fmt: skip
    """Decode steps whose rows run under adapters take the native op and are replayed
    (worker_proc.runtime.step_replay): the same logits as a runner that runs every step as written; a slot that
    takes another adapter drops the programs, so the next steps read the new adapter's tensors."""
    name = "falcon_h1"
    prompt = reference(name)["prompt"].tolist()
    one, two = (adapter_of(name, d) for d in pairs[name])
    r = runner(name, kv_slots=256, max_loras=3)
    if not r.replays.enabled:
        pytest.skip("step replay needs the native kernels")
    eager = runner(name, kv_slots=256, max_loras=3, enforce_eager=True)
    loads = [LoraLoad(slot=1, adapter=one), LoraLoad(slot=3, adapter=two)]
    reqs = {"x": (prompt[:9], 1), "base": (prompt[3:12], 0), "y": (prompt[:7], 3)}
    for _ in range(2):  # the second run's decode steps replay the programs the first recorded
        replayed = r.replays.replayed
        served = _serve(r, reqs, loads)
        expected = _serve(eager, reqs, loads)
        for rid in reqs:
            assert all(torch.equal(a, b) for a, b in zip(served[rid], expected[rid], strict=True)), rid
    assert r.replays.replayed > replayed and r.replays.programs() > 0
    swapped = [LoraLoad(slot=1, adapter=two)]  # slot 1 now holds the second adapter
    served, expected = _serve(r, reqs, swapped), _serve(eager, reqs, swapped)
    for rid in reqs:
        assert all(torch.equal(a, b) for a, b in zip(served[rid], expected[rid], strict=True)), rid
    assert (served["x"][-1] - served["y"][-1]).abs().max() > 0  # different prompts, now the same adapter


@pytest.mark.parametrize("name", ["falcon_h1", "qwen3_5_moe"])
def test_the_native_form_of_a_few_rows_under_several_adapters_equals_each_alone(
        name: str, pairs: dict[str, tuple[str, str]]) -> None:  # fmt: skip
    """Default numerics: decode steps (a few rows under two adapters and the base) take the native op
    (ExecutionPlan.lora_native_rows); each request's logits equal its own run alone within float rounding, and the
    base rows equal a runner without LoRA."""
    one, two = (adapter_of(name, d) for d in pairs[name])
    loads = [LoraLoad(slot=1, adapter=one), LoraLoad(slot=3, adapter=two)]
    prompt = reference(name)["prompt"].tolist()
    reqs = {"x": (prompt[:9], 1), "base": (prompt[3:12], 0), "y": (prompt[:7], 3), "x2": (prompt[5:9], 1)}
    mixed_runner = runner(name, kv_slots=256, max_loras=3)
    assert mixed_runner.loras is not None and mixed_runner.loras.native_rows > 0
    mixed = _serve(mixed_runner, reqs, loads)
    alone_runner = runner(name, kv_slots=256, max_loras=3)
    base_runner = runner(name, kv_slots=256)
    for rid, spec in reqs.items():
        alone = _serve(alone_runner, {rid: spec}, loads)[rid]
        for a, b in zip(mixed[rid], alone, strict=True):
            assert (a - b).abs().max() <= 1e-4, rid
        if spec[1] == 0:
            plain = _serve(base_runner, {rid: spec}, [])[rid]
            assert all((a - b).abs().max() <= 1e-4 for a, b in zip(mixed[rid], plain, strict=True)), rid
    assert (mixed["x"][-1] - _serve(base_runner, {"x": (prompt[:9], 0)}, [])["x"][-1]).abs().max() > 0.05
