"""make_bench_model: published shapes (config only for the big ones) and a reduced checkpoint written
in full and loaded through hyssm's own loader, tokenizer and model runtime."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks.bench_model_shapes import SHAPES, bench_config, num_params, tensor_shapes
from benchmarks.make_bench_model import main, make_bench_model
from shared.families.registry import parse_config
from shared.model_info import ModelInfo
from tests.model_driver import forward_all_logits, generate_greedy
from tokenizer_proc.requests.tokenizer import TextTokenizer
from worker_proc.loading.checkpoint import load_model
from worker_proc.model.hybrid import HybridForCausalLM
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

pytestmark = pytest.mark.timeout(240)

# The published numbers, restated independently of bench_model_shapes:
# (layers, attention layer ids, hidden, attn heads, kv heads, mamba heads, mamba head dim, d_state,
#  groups, shared MLP, experts, top-k, expert MLP, approx. total params)
PUBLISHED = {
    "granite-4.0-h-350m": (32, [10, 13, 17, 27], 768, 12, 4, 48, 32, 128, 1, 2048, 0, 0, None, 340e6),
    "granite-4.0-h-1b": (40, [5, 15, 25, 35], 1536, 12, 4, 48, 64, 128, 1, 4096, 0, 0, None, 1.46e9),
    "granite-4.0-h-micro": (40, [5, 15, 25, 35], 2048, 32, 8, 64, 64, 128, 1, 8192, 0, 0, None, 3.19e9),
    "granite-4.0-h-tiny": (40, [5, 15, 25, 35], 1536, 12, 4, 48, 64, 128, 1, 1024, 64, 6, 512, 6.94e9),
}
EOS_ID, PAD_ID, VOCAB = 100257, 100256, 100352


@pytest.mark.parametrize("shape", sorted(PUBLISHED))
def test_config_has_the_published_shape(shape: str) -> None:
    layers, attn, hidden, heads, kv, mh, md, state, groups, shared, experts, topk, expert_mlp, params = PUBLISHED[shape]
    cfg = bench_config(shape)
    assert cfg["architectures"] == ["GraniteMoeHybridForCausalLM"] and cfg["vocab_size"] == VOCAB
    kinds = cfg["layer_types"]
    assert cfg["num_hidden_layers"] == len(kinds) == layers  # type: ignore[arg-type]
    assert [i for i, k in enumerate(kinds) if k == "attention"] == attn  # type: ignore[arg-type]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (hidden, heads, kv)
    assert (cfg["mamba_n_heads"], cfg["mamba_d_head"], cfg["mamba_d_state"]) == (mh, md, state)
    assert (cfg["mamba_n_groups"], cfg["mamba_d_conv"], cfg["mamba_expand"]) == (groups, 4, 2)
    assert mh * md == 2 * hidden  # mamba_expand 2
    assert cfg["shared_intermediate_size"] == shared
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (experts, topk)
    if expert_mlp is not None:
        assert cfg["intermediate_size"] == expert_mlp
    assert cfg["tie_word_embeddings"] is True and cfg["embedding_multiplier"] == 12.0
    assert num_params(cfg) == pytest.approx(params, rel=0.01)
    # hyssm's own model, built on the meta device (no memory), has exactly these tensors
    model = HybridForCausalLM(parse_config(cfg), torch.float32, "meta")
    want = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert dict(tensor_shapes(cfg)) == want


def test_reduced_layers_keep_both_kinds_and_bad_values_are_refused() -> None:
    assert bench_config("granite-4.0-h-350m", num_layers=2)["layer_types"] == ["mamba", "attention"]
    assert bench_config("granite-4.0-h-350m", num_layers=14)["layer_types"].count("attention") == 2  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="num-layers"):
        bench_config("granite-4.0-h-1b", num_layers=41)
    with pytest.raises(ValueError, match="unknown shape"):
        bench_config("granite-9")
    assert set(SHAPES) == set(PUBLISHED)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "g350m-2l"
    make_bench_model(str(out), "granite-4.0-h-350m", num_layers=2, seed=3, show_progress=False)
    return out


def test_checkpoint_files_and_tokenizer(small_ckpt: Path) -> None:
    files = sorted(os.listdir(small_ckpt))
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]  # fmt: skip
    info = ModelInfo.from_dir(str(small_ckpt))
    assert info.vocab_size == VOCAB and info.eos_token_ids == (EOS_ID,) and info.layer_kinds == ("mamba", "attention")
    gen = json.loads((small_ckpt / "generation_config.json").read_text())
    assert gen == {"bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    tok = TextTokenizer.from_dir(str(small_ckpt), info)
    assert tok.tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB
    assert tok.eos_token_ids == (EOS_ID,) and tok.tokenizer.id_to_token(EOS_ID) == "<|end_of_text|>"
    text = "Hello world, the quick brown fox: 12345 ok? é ✓"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges are used
    assert all(0 <= t < VOCAB for t in ids) and tok.tokenizer.decode(ids) == text
    chat = tok.render_chat([{"role": "user", "content": "hi"}])
    assert chat.startswith("<|start_of_role|>user<|end_of_role|>hi<|end_of_text|>")
    assert tok.encode(chat).count(EOS_ID) == 1  # special tokens are single ids


def test_loads_in_hyssm_and_logits_stay_alive_over_640_tokens(small_ckpt: Path) -> None:
    runner = ModelRunner(str(small_ckpt), WorkerConfig(dtype="float32", kv_slots=700, state_slots=2))
    from shared.messages import ForwardBatch, ReqSlice, SamplingParams

    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(640)]
    req = ReqSlice(rid="r", input_ids=prompt, start_pos=0, kv_slots=list(range(1, 641)), state_slot=1,
                   sample=True, sampling=SamplingParams(temperature=0.0), output_len=0)  # fmt: skip
    logits = forward_all_logits(runner, ForwardBatch(step=0, reqs=[req], clears=[1]))["r"]
    assert logits.shape == (640, VOCAB) and bool(torch.isfinite(logits).all())
    spread = logits.std(dim=-1)
    assert float(spread.min()) > 1e-3  # not flat at any position, including the last ones
    assert len(set(logits.argmax(dim=-1).tolist())) > 300  # greedy choice depends on the input
    out = generate_greedy(
        ModelRunner(str(small_ckpt), WorkerConfig(dtype="float32", kv_slots=80, state_slots=2)), prompt[:64], 8
    )
    assert len(out) == 8 and all(0 <= t < VOCAB for t in out)


def test_sharded_bf16_checkpoint_equals_the_single_file(small_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "sharded"
    make_bench_model(str(out), "granite-4.0-h-350m", num_layers=2, seed=3, dtype="bfloat16", max_shard_gb=0.004,
                     show_progress=False)  # fmt: skip
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).is_file() for s in shards)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    bf16 = load_model(str(out), dtype="bfloat16")
    f32 = load_model(str(small_ckpt), dtype="float32")
    for (name, a), (_, b) in zip(bf16.named_parameters(), f32.named_parameters(), strict=True):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b.to(torch.bfloat16)), name  # same seed, same values, one rounding
    with safe_open(str(out / shards[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_init_follows_mamba2_reference_ranges(small_ckpt: Path) -> None:
    with safe_open(str(small_ckpt / "model.safetensors"), framework="pt") as f:
        a = -torch.exp(f.get_tensor("model.layers.0.mamba.A_log"))
        dt = torch.nn.functional.softplus(f.get_tensor("model.layers.0.mamba.dt_bias"))
        emb = f.get_tensor("model.embed_tokens.weight")
        assert bool(((a <= -1.0) & (a >= -16.0)).all())
        assert bool(((dt >= 1e-4 * 0.99) & (dt <= 0.1 * 1.01)).all())
        assert torch.equal(f.get_tensor("model.layers.0.mamba.D"), torch.ones(48))
        assert float(emb.std()) == pytest.approx(0.02, rel=0.02)
        assert "lm_head.weight" not in f.keys()  # tied
    assert math.isclose(float(emb.mean()), 0.0, abs_tol=1e-3)


def test_cli_refuses_unknown_shape_and_an_existing_checkpoint(small_ckpt: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--shape", "granite-9", "x"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["--shape", "granite-4.0-h-350m", str(small_ckpt), "--num-layers", "2"])
    assert exc.value.code == 2 and "already holds a checkpoint" in capsys.readouterr().err


def test_other_families_shapes_are_known(tmp_path: Path) -> None:
    """make_bench_model also writes one real shape per other family (weights and config, reduced here)."""
    import json

    from benchmarks import make_bench_model

    for shape, arch in (("falcon-h1-0.5b", "FalconH1ForCausalLM"),):  # the smallest vocabulary of them
        out = tmp_path / shape
        assert make_bench_model.main(["--shape", shape, str(out), "--num-layers", "1"]) == 0
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == [arch]
        assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "shape, gdn, attn, params", [("qwen3.5-0.8b", 18, 6, 0.752e9), ("qwen3-next-80b-a3b", 36, 12, 79.67e9)]
)
def test_gated_deltanet_shapes_are_the_published_ones(shape: str, gdn: int, attn: int, params: float) -> None:
    """The Qwen shapes parse into their layer pattern and parameter count (text model; built on
    the meta device), and a reduction keeps one layer of each kind."""
    from benchmarks.make_family_model import SHAPES, truncate
    from shared.families.registry import parse_config
    from worker_proc.model import HybridForCausalLM

    cfg = parse_config(dict(SHAPES[shape]))
    assert (cfg.layer_kinds.count("gdn"), cfg.layer_kinds.count("attention")) == (gdn, attn)
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, torch.float32, "meta")
    assert abs(sum(p.numel() for p in model.parameters()) - params) / params < 1e-3
    assert parse_config(truncate(SHAPES[shape], 2)).layer_kinds == ("gdn", "attention")


def test_lfm2_shape_is_the_published_one() -> None:
    """LFM2-1.2B parses into its 10 short convolutions and 6 attention layers and 1.17B parameters (meta
    device), and a reduction keeps one layer of each kind."""
    from benchmarks.make_family_model import SHAPES, truncate
    from shared.families.registry import parse_config
    from worker_proc.model import HybridForCausalLM

    cfg = parse_config(dict(SHAPES["lfm2-1.2b"]))
    assert (cfg.layer_kinds.count("short_conv"), cfg.layer_kinds.count("attention")) == (10, 6)
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, torch.float32, "meta")
    assert abs(sum(p.numel() for p in model.parameters()) - 1.17e9) / 1.17e9 < 5e-3
    assert parse_config(truncate(SHAPES["lfm2-1.2b"], 2)).layer_kinds == ("short_conv", "attention")


def test_kimi_linear_shape_is_the_published_one() -> None:
    """Kimi-Linear-48B-A3B parses into its 20 KDA and 7 MLA layers, and its parameters are transformers' own
    count from the same config (meta device; the routers' score-correction biases are buffers there);
    a reduction keeps one layer of each kind."""
    transformers = pytest.importorskip("transformers")
    from benchmarks.make_family_model import SHAPES, truncate
    from shared.families.registry import parse_config
    from worker_proc.model import HybridForCausalLM

    shape = SHAPES["kimi-linear-48b-a3b"]
    cfg = parse_config(dict(shape))
    assert (cfg.layer_kinds.count("kda"), cfg.layer_kinds.count("attention")) == (20, 7)
    with torch.device("meta"):
        ours = sum(p.numel() for p in HybridForCausalLM(cfg, torch.float32, "meta").parameters())
        hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(
            **{k: v for k, v in shape.items() if k != "architectures"}))
    biases = sum(b.numel() for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias"))
    assert ours == sum(p.numel() for p in hf.parameters()) + biases
    assert parse_config(truncate(shape, 2)).layer_kinds == ("kda", "attention")


def test_falcon_mamba_shape_is_the_published_one() -> None:
    """Falcon-Mamba-7B parses into 64 Mamba1 layers and 7.27B parameters (meta device), its state slot the
    64 layers' [8192, 3] conv windows and [8192, 16] states."""
    from benchmarks.make_family_model import SHAPES, truncate
    from shared.families.registry import parse_config
    from worker_proc.model import HybridForCausalLM
    from worker_proc.state.pools import slot_bytes

    cfg = parse_config(dict(SHAPES["falcon-mamba-7b"]))
    assert cfg.layer_kinds == ("mamba1",) * 64 and cfg.mamba1.bcdt_norm == "weightless"
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, torch.float32, "meta")
    assert abs(sum(p.numel() for p in model.parameters()) - 7.27e9) / 7.27e9 < 5e-3
    assert slot_bytes(cfg, torch.float32).state_slot == 64 * 8192 * (3 + 16) * 4
    assert parse_config(truncate(SHAPES["falcon-mamba-7b"], 2)).layer_kinds == ("mamba1",) * 2


def test_transformers_init_has_the_generators_layout_and_transformers_values(small_ckpt: Path, tmp_path: Path) -> None:
    """--init transformers: the generator's tensor names and shapes, hyssm loads it, and the values are
    those of transformers' own from_config (same seed) rather than the generator's."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "tf"
    assert main(["--shape", "granite-4.0-h-350m", str(out), "--num-layers", "2", "--seed", "3",
                 "--init", "transformers", "--log-level", "WARNING"]) == 0  # fmt: skip
    assert sorted(os.listdir(out)) == sorted(os.listdir(small_ckpt))
    assert json.loads((out / "config.json").read_text()) == json.loads((small_ckpt / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        ours = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(str(small_ckpt / "model.safetensors"), framework="pt") as f:
        gen = {k: f.get_tensor(k) for k in f.keys()}
    assert list(ours) == list(gen) and {k: t.shape for k, t in ours.items()} == {k: t.shape for k, t in gen.items()}
    assert not torch.equal(ours["model.embed_tokens.weight"], gen["model.embed_tokens.weight"])
    assert not torch.equal(ours["model.layers.0.mamba.A_log"], gen["model.layers.0.mamba.A_log"])
    # transformers' Mamba init: A_log = log(1..heads); norms 1
    assert torch.allclose(ours["model.layers.0.mamba.A_log"], torch.log(torch.arange(1, 49, dtype=torch.float32)))
    assert torch.equal(ours["model.layers.1.input_layernorm.weight"], torch.ones(768))
    assert torch.equal(ours["model.layers.0.mamba.norm.weight"], torch.ones(1536))
    # and exactly what transformers builds from the written config with that seed
    torch.manual_seed(3)
    config = transformers.AutoConfig.from_pretrained(str(out))
    ref = transformers.AutoModelForCausalLM.from_config(config).state_dict()  # config.json: float32
    assert all(torch.equal(t, ref[k]) for k, t in ours.items())
    model = load_model(str(out), dtype="float32")
    params = dict(model.named_parameters())
    assert set(params) == set(ours) and torch.equal(params["model.layers.0.mamba.D"], ours["model.layers.0.mamba.D"])


def test_transformers_init_of_another_family_writes_its_transformers_layout(tmp_path: Path) -> None:
    """--init transformers for another family's shape: make_family_model's transformers layout (transformers'
    class and save_pretrained, the bench tokenizer, --dtype weights)."""
    pytest.importorskip("transformers")
    out = tmp_path / "x"
    assert main(["--shape", "falcon-h1-0.5b", str(out), "--init", "transformers", "--num-layers", "1",
                 "--dtype", "bfloat16", "--log-level", "WARNING"]) == 0  # fmt: skip
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["FalconH1ForCausalLM"] and cfg["model_type"] == "falcon_h1"
    assert cfg["dtype"] == "bfloat16" and cfg["num_hidden_layers"] == 1
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
