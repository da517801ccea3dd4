"""The model registry (shared/architectures.py): architectures[0] picks one family module; every
family is assembled from the shared blocks; an unknown architecture is one line listing the
supported ones; the family-specific spellings and checkpoint layouts load."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.architectures import FAMILIES, SUPPORTED_ARCHITECTURES, parse_config, summary
from shared.errors import ModelLoadError
from shared.model_info import ModelInfo, read_config_json
from tests.worker.util import ALL_FIXTURES, fixture_dir, runner
from worker_proc.loader import load_config, load_model

SHARED_BLOCK_MODULES = {
    "worker_proc.model.hybrid", "worker_proc.model.layers", "worker_proc.model.mamba",
    "worker_proc.model.attention", "worker_proc.model.moe", "worker_proc.model.tp", "torch.nn.modules.container",
    "torch.nn.modules.module",
}


def _config(name: str) -> dict:
    return read_config_json(fixture_dir(name))


def test_unknown_architecture_is_one_line_listing_the_supported() -> None:
    for cfg in ({"architectures": ["LlamaForCausalLM"]}, {}):
        with pytest.raises(ModelLoadError) as err:
            parse_config(cfg, "x/config.json")
        msg = str(err.value)
        assert "\n" not in msg and "x/config.json" in msg
        assert all(arch in msg for arch in SUPPORTED_ARCHITECTURES)
    assert set(SUPPORTED_ARCHITECTURES) == {
        "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "FalconH1ForCausalLM", "BambaForCausalLM",
        "Mamba2ForCausalLM",
    }


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_every_family_is_built_from_the_shared_blocks(name: str) -> None:
    cfg = load_config(fixture_dir(name))
    assert cfg.architecture == _config(name)["architectures"][0]
    r = runner(name)
    for module in r.model.modules():
        assert type(module).__module__ in SHARED_BLOCK_MODULES, type(module)
    info = ModelInfo.from_dir(fixture_dir(name))  # the torch-free summary agrees with the full parse
    assert (info.layer_kinds, info.max_position_embeddings) == (cfg.layer_kinds, cfg.max_position_embeddings)
    no_context = {k: v for k, v in _config(name).items() if k != "max_position_embeddings"}
    assert parse_config(no_context).max_position_embeddings == summary(no_context)[2]


def test_family_modules_are_torch_free() -> None:
    """The launcher and the scheduler parse configs without importing torch."""
    import subprocess
    import sys

    code = ("import sys; from shared.architectures import parse_config, family_module, FAMILIES; "
            "[family_module(a) for a in FAMILIES]; assert 'torch' not in sys.modules, 'torch imported'")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": root})
    assert res.returncode == 0, res.stderr
    assert len(FAMILIES) == 5


def test_nemotron_pattern_and_block_type_spellings_agree() -> None:
    cfg = _config("nemotron_h_dense")
    assert cfg["hybrid_override_pattern"] == "M*-M-*"
    by_list = dict(cfg)
    del by_list["hybrid_override_pattern"]
    by_list["layers_block_type"] = ["mamba", "attention", "mlp", "mamba", "mlp", "attention"]
    assert parse_config(by_list) == parse_config(cfg)
    bad = dict(cfg, hybrid_override_pattern="M*X")
    with pytest.raises(ModelLoadError, match="hybrid_override_pattern character 'X'"):
        parse_config(bad)


def test_bamba_attn_layer_indices_out_of_range() -> None:
    with pytest.raises(ModelLoadError, match="attn_layer_indices 9"):
        parse_config(dict(_config("bamba"), attn_layer_indices=[1, 9]))


def _copy(tmp_path, name: str) -> str:
    out = tmp_path / name
    out.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(fixture_dir(name), f), out / f)
    return str(out)


def test_nemotron_mtp_tensors_skipped_and_per_expert_rows_checked(tmp_path, caplog) -> None:
    path = _copy(tmp_path, "nemotron_h_moe")
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in tensors  # per-expert layout on disk
    save_file({**tensors, "mtp.layers.0.mixer.q_proj.weight": torch.zeros(4, 4)}, weights)
    with caplog.at_level("INFO", logger="worker_proc.loader"):
        model = load_model(path)  # MTP layer ignored, with one log line
    assert any("1 checkpoint tensors under mtp. not loaded" in r.message for r in caplog.records)
    expected = load_model(fixture_dir("nemotron_h_moe"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected.parameters(), strict=True))
    del tensors["backbone.layers.3.mixer.experts.5.down_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.mixer\.experts\.down_proj"):
        load_model(path)
    save_file({**tensors, "backbone.layers.3.mixer.experts.5.down_proj.weight": torch.zeros(3, 3)}, weights)
    with pytest.raises(ModelLoadError, match=r"experts\.5\.down_proj\.weight.*shape"):
        load_model(path)


def test_tp_refuses_mlp_bias_in_one_line() -> None:
    from worker_proc.model.config import tp_layout_error

    cfg = parse_config(dict(_config("bamba"), mlp_bias=True))
    assert tp_layout_error(cfg, 1) is None
    assert "mlp_bias" in (tp_layout_error(cfg, 2) or "")
