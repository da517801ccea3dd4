"""`shared.lora.read_adapter`: what a PEFT adapter directory must be to be served, each refusal one line
naming the problem (rank above --max-lora-rank, a target module the model lacks, an adapter of another base
model, modules_to_save, DoRA, target_parameters, missing files, a tensor without its pair); scaling with and
without rsLoRA; the uid a digest of the files; `linear_layers` the model's own linear layers, name and shape,
for every family."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from shared.lora import LoraError, linear_layers, read_adapter
from tests.worker.lora_util import make_adapter
from tests.worker.util import ALL_FIXTURES, GDN_FIXTURES, fixture_dir
from worker_proc.loading.checkpoint import load_config, load_model
from worker_proc.model.layers import Linear

BASE = "falcon_h1"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_adapter(fixture_dir(BASE), str(tmp_path_factory.mktemp("good") / "a"), ["q_proj", "in_proj", "up_proj"],
                        r=8, alpha=16.0)


def _read(path: str, max_rank: int = 16, model: str = BASE):
    return read_adapter("ad", path, load_config(fixture_dir(model)), max_rank)


def _edited(src: str, dst: str, **changes: object) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("name", ALL_FIXTURES + GDN_FIXTURES)
def test_linear_layers_are_the_models(name: str) -> None:
    model = load_model(fixture_dir(name))
    ours = {n: tuple(m.weight.shape) for n, m in model.named_modules()
            if isinstance(m, Linear) and n.startswith("model.layers.") and not n.endswith("router.layer")}
    assert linear_layers(model.cfg) == ours


def test_a_good_adapter(good: str, tmp_path) -> None:
    a = _read(good)
    assert a.rank == 8 and a.scaling == 2.0 and a.path == good
    assert len(a.uid) == 64 and a.uid == _read(good).uid
    assert a.targets == tuple(sorted(f"model.layers.{i}.{m}" for i in range(3)
                                     for m in ("self_attn.q_proj", "mamba.in_proj", "feed_forward.up_proj")))
    rs = make_adapter(fixture_dir(BASE), str(tmp_path / "rs"), ["q_proj"], r=4, alpha=6.0, rslora=True)
    assert _read(rs).scaling == 3.0  # alpha / sqrt(r)
    assert _read(rs).uid != a.uid
    lora_dropout_only = _edited(good, str(tmp_path / "dropout"), lora_dropout=0.5)
    assert _read(lora_dropout_only).rank == 8  # dropout is a training setting


def test_refusals(good: str, tmp_path) -> None:
    with pytest.raises(LoraError, match="rank 8 exceeds --max-lora-rank 4"):
        _read(good, max_rank=4)
    with pytest.raises(LoraError, match=r"target module 'w_gate': FalconH1ForCausalLM has no linear layer"):
        _read(_edited(good, str(tmp_path / "unknown"), target_modules=["q_proj", "w_gate"]))
    with pytest.raises(LoraError, match="lm_head.*take no adapter"):
        _read(_edited(good, str(tmp_path / "head"), target_modules=["lm_head"]))
    with pytest.raises(LoraError, match="shape .* expected .*another base model"):
        _read(good, model="bamba")
    with pytest.raises(LoraError, match="modules_to_save"):
        _read(_edited(good, str(tmp_path / "save"), modules_to_save=["lm_head"]))
    with pytest.raises(LoraError, match="DoRA"):
        _read(_edited(good, str(tmp_path / "dora"), use_dora=True))
    with pytest.raises(LoraError, match="peft_type 'IA3'"):
        _read(_edited(good, str(tmp_path / "ia3"), peft_type="IA3"))
    with pytest.raises(LoraError, match="rank_pattern"):
        _read(_edited(good, str(tmp_path / "pattern"), rank_pattern={"q_proj": 4}))
    with pytest.raises(LoraError, match="has no adapter_config.json"):
        _read(str(tmp_path))
    weights_gone = shutil.copytree(good, tmp_path / "noweights")
    os.rename(weights_gone / "adapter_model.safetensors", weights_gone / "adapter_model.bin")
    with pytest.raises(LoraError, match="no adapter_model.safetensors .*safe_serialization"):
        _read(str(weights_gone))
    with pytest.raises(LoraError, match="is not a directory"):
        _read(str(tmp_path / "nowhere"))
    with pytest.raises(LoraError) as info:
        _read(good, model="qwen3_5_dense")
    assert "\n" not in str(info.value) and "'ad'" in str(info.value)


def test_peft_modules_to_save_and_dora_adapters_are_refused(tmp_path) -> None:
    with pytest.raises(LoraError, match="modules_to_save"):
        _read(make_adapter(fixture_dir(BASE), str(tmp_path / "s"), ["q_proj"], modules_to_save=["lm_head"]))
    with pytest.raises(LoraError, match="DoRA"):
        _read(make_adapter(fixture_dir(BASE), str(tmp_path / "d"), ["q_proj"], use_dora=True))


def test_peft_expert_targets_are_refused(tmp_path) -> None:
    """PEFT turns gate/up/down_proj of Qwen3-Next into target_parameters of the routed experts' stacks."""
    path = make_adapter(fixture_dir("qwen3_next_moe"), str(tmp_path / "e"), ["down_proj"], lora_dropout=0.0)
    with pytest.raises(LoraError, match="target_parameters"):
        _read(path, model="qwen3_next_moe")


def test_a_tensor_without_its_pair_is_refused(good: str, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    dst = shutil.copytree(good, tmp_path / "lone")
    tensors = load_file(dst / "adapter_model.safetensors")
    dropped = next(k for k in tensors if k.endswith("lora_B.weight"))
    del tensors[dropped]
    save_file(tensors, dst / "adapter_model.safetensors")
    with pytest.raises(LoraError, match="has lora_A without its other matrix"):
        _read(str(dst))
