"""The model registry (shared/families/registry.py): architectures[0] picks one family module; every
family is assembled from the shared blocks; an unknown architecture is one line listing the
supported ones; the family-specific spellings and checkpoint layouts load."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.errors import ModelLoadError
from shared.families.registry import FAMILIES, SUPPORTED_ARCHITECTURES, parse_config, summary
from shared.model_info import ModelInfo, read_config_json
from tests.fixtures.kimi_linear_model import KIMI_CONFIGS, kimi_dir
from tests.fixtures.lfm2_model import LFM2_CONFIGS, lfm2_dir
from tests.worker.util import ALL_FIXTURES, GDN_FIXTURES, fixture_dir, reference, runner_at
from worker_proc.loading.checkpoint import load_config, load_model

SHARED_BLOCK_MODULES = {
    "worker_proc.model.hybrid", "worker_proc.model.layers", "worker_proc.model.mamba",
    "worker_proc.model.attention", "worker_proc.model.moe", "worker_proc.model.tp", "torch.nn.modules.container",
    "worker_proc.model.gated_deltanet", "worker_proc.model.qwen_moe", "worker_proc.model.short_conv",
    "worker_proc.model.sigmoid_moe", "worker_proc.model.kimi_delta", "worker_proc.model.latent_attention",
    "worker_proc.model.grouped_moe",
    "torch.nn.modules.module",
}


def _dir(name: str) -> str:
    """A checked-in fixture's directory, or an LFM2 or Kimi Linear checkpoint built by transformers
    (tests/fixtures/lfm2_model.py, tests/fixtures/kimi_linear_model.py)."""
    if name in KIMI_CONFIGS:
        return kimi_dir(name)
    return lfm2_dir(name) if name in LFM2_CONFIGS else fixture_dir(name)


def _config(name: str) -> dict:
    return read_config_json(_dir(name))


def test_unknown_architecture_is_one_line_listing_the_supported() -> None:
    for cfg in ({"architectures": ["LlamaForCausalLM"]}, {}):
        with pytest.raises(ModelLoadError) as err:
            parse_config(cfg, "x/config.json")
        msg = str(err.value)
        assert "\n" not in msg and "x/config.json" in msg
        assert all(arch in msg for arch in SUPPORTED_ARCHITECTURES)
    assert set(SUPPORTED_ARCHITECTURES) == {
        "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "FalconH1ForCausalLM", "BambaForCausalLM",
        "Mamba2ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration", "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM", "KimiLinearForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM",
        "JambaForCausalLM",
    }


@pytest.mark.parametrize("name", ALL_FIXTURES + GDN_FIXTURES + tuple(LFM2_CONFIGS) + tuple(KIMI_CONFIGS))
def test_every_family_is_built_from_the_shared_blocks(name: str) -> None:
    cfg = load_config(_dir(name))
    assert cfg.architecture == _config(name)["architectures"][0]
    r = runner_at(_dir(name))
    for module in r.model.modules():
        assert type(module).__module__ in SHARED_BLOCK_MODULES, type(module)
    info = ModelInfo.from_dir(_dir(name))  # the torch-free summary agrees with the full parse
    assert (info.layer_kinds, info.max_position_embeddings) == (cfg.layer_kinds, cfg.max_position_embeddings)
    no_context = {k: v for k, v in _config(name).items() if k != "max_position_embeddings"}
    assert parse_config(no_context).max_position_embeddings == summary(no_context)[2]


@pytest.mark.parametrize("name", ALL_FIXTURES + GDN_FIXTURES + tuple(LFM2_CONFIGS) + tuple(KIMI_CONFIGS))
def test_every_layer_kind_has_its_config_part(name: str) -> None:
    """A family fills the part of every block kind it uses; a config with a kind but without its part's
    sizes is refused at construction, naming the kind."""
    cfg = load_config(_dir(name))
    kinds = {b.kind for b in cfg.blocks()}
    parts = {"attention": cfg.attn.num_heads, "mamba": cfg.mamba.n_heads, "gdn": cfg.gdn.k_heads,
             "short_conv": cfg.short_conv.d_conv, "kda": cfg.kda.heads, "mla": cfg.mla.kv_lora_rank}
    assert all(parts[k] > 0 for k in kinds & parts.keys())
    assert cfg.moe.num_experts > 0 if any(k.endswith("moe") for k in kinds) else cfg.moe.num_experts == 0
    for kind, part in (("attention", "attn"), ("mamba", "mamba"), ("gdn", "gdn"), ("short_conv", "short_conv"),
                       ("kda", "kda"), ("mla", "mla")):
        if kind in kinds:
            with pytest.raises(ValueError, match=f"has {kind} layers"):
                dataclasses.replace(cfg, **{part: type(getattr(cfg, part))()})


def test_family_modules_are_torch_free() -> None:
    """The launcher and the scheduler parse configs without importing torch."""
    import subprocess
    import sys

    code = ("import sys; from shared.families.registry import parse_config, FAMILIES; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": root})
    assert res.returncode == 0, res.stderr
    assert len({id(f) for f in FAMILIES.values()}) == 10


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
    with caplog.at_level("INFO", logger="worker_proc.loading.weight_files"):
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
    from shared.model_config import tp_layout_error

    cfg = parse_config(dict(_config("bamba"), mlp_bias=True))
    assert tp_layout_error(cfg, 1) is None
    assert "mlp_bias" in (tp_layout_error(cfg, 2) or "")


def test_qwen3_5_multimodal_wrapper_loads_its_text_model(tmp_path, caplog) -> None:
    """A Qwen3.5 wrapper checkpoint (Qwen3_5ForConditionalGeneration: `text_config`, tensors under
    `model.language_model.`, MTP layers) whose vision_config has no blocks serves its text model: same
    weights, same logits as the text-only fixture; the stray vision and the MTP tensors are skipped with
    a log line (a tower with blocks is loaded: tests/worker/test_vision.py)."""
    import json

    from tests.model_driver import forward_all_logits
    from tests.worker.util import batch, max_diff, req
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    src = _config("qwen3_5_dense")
    text = {k: v for k, v in src.items() if k not in ("architectures", "tie_word_embeddings")}
    wrapper = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "tie_word_embeddings": src["tie_word_embeddings"], "text_config": text, "vision_config": {"depth": 0}}
    out = tmp_path / "wrapped"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(wrapper))
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(os.path.join(fixture_dir("qwen3_5_dense"), "model.safetensors")).items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(out / "model.safetensors"))
    info = ModelInfo.from_dir(str(out))
    assert info.vocab_size == src["vocab_size"] and info.max_position_embeddings == src["max_position_embeddings"]
    assert info.layer_kinds == ("gdn", "gdn", "attention", "gdn") and info.has_recurrent_state
    with caplog.at_level("INFO", logger="worker_proc.loading.weight_files"):
        r = ModelRunner(str(out), WorkerConfig(kv_slots=200, state_slots=4))
    assert any("visual." in rec.message for rec in caplog.records)
    ref = reference("qwen3_5_dense")
    prompt = ref["prompt"].tolist()
    n = len(prompt)
    logits = forward_all_logits(r, batch(0, [req("a", prompt, 0, list(range(1, n + 1)), 1)], clears=[1]))["a"]
    assert max_diff(logits, ref["prompt_logits"]) <= 1e-4


def _mlp_kinds(cfg: object) -> list[str]:
    return [b.kind for layer in cfg.layers() for sub in layer for b in sub.blocks if sub.norm.startswith("post")]


def test_qwen_configs_refuse_bad_layouts_in_one_line() -> None:
    cfg = _config("qwen3_next_moe")
    with pytest.raises(ModelLoadError, match="linear_num_key_heads 3 does not divide linear_num_value_heads 4"):
        parse_config(dict(cfg, linear_num_key_heads=3))
    with pytest.raises(ModelLoadError, match="unknown layer_types entry 'mamba'"):
        parse_config(dict(cfg, layer_types=["mamba"] * 4))
    from shared.model_config import tp_layout_error

    parsed = parse_config(cfg)
    assert tp_layout_error(parsed, 2) is None
    assert "linear_num_key_heads 2" in (tp_layout_error(parsed, 4) or "")
    kinds = _mlp_kinds(parsed)
    assert kinds == ["shared_gate_moe", "shared_gate_moe", "gated_mlp", "shared_gate_moe"]  # mlp_only_layers [2]
    every_other = parse_config(dict(cfg, mlp_only_layers=[], decoder_sparse_step=2))
    kinds = _mlp_kinds(every_other)
    assert kinds == ["gated_mlp", "shared_gate_moe", "gated_mlp", "shared_gate_moe"]
