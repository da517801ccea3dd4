"""make_family_model's transformers layout: a family shape built by transformers' own class and config (its
init), written by save_pretrained with the bench tokenizer, loads in transformers and in hyssm alike: the
same greedy tokens and prompt logits from the same prompt (both in float32, at a tiny width of the shape)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks.make_family_model import truncate, write_transformers
from tests.model_driver import forward_all_logits, generate_greedy
from tests.worker.util import batch, req
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

pytestmark = pytest.mark.timeout(240)

TINY = {
    # LFM2-1.2B's pattern and field spellings (block_ff_dim, tie_embedding, conv_L_cache), narrowed
    "lfm2-1.2b": dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, block_ff_dim=192,
                      block_multiple_of=32),
    # Falcon-Mamba-7B's weightless dt/B/C norms and untied head, narrowed
    "falcon-mamba-7b": dict(vocab_size=512, hidden_size=64, intermediate_size=128, time_step_rank=8),
}
NEW_TOKENS = 8
LOGIT_TOL = 1e-5
"""Max abs difference of the prompt logits relative to their largest magnitude (float32 both; measured 2e-7 for
LFM2, 3e-7 for FalconMamba). LFM2 under transformers' init repeats one token, so the logits carry the check."""


@pytest.mark.parametrize("shape", sorted(TINY))
def test_transformers_layout_loads_in_transformers_and_hyssm_alike(tmp_path: Path, shape: str) -> None:
    transformers = pytest.importorskip("transformers")
    out = str(tmp_path / shape)
    write_transformers(out, shape, num_layers=3, seed=5, fields=TINY[shape])
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    assert not [p for p in os.listdir(tmp_path) if p != shape]  # the build folder was renamed into place
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(out, "tokenizer.json")) as f:
        specials = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
    assert cfg["eos_token_id"] == specials["<|end_of_text|>"] and cfg["num_hidden_layers"] == 3

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = [(7 * i + 3) % 250 + 5 for i in range(12)]
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt]), use_cache=False).logits[0]
        hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False)[0, len(prompt):].tolist()  # fmt: skip
    runner = ModelRunner(out, WorkerConfig(dtype="float32", kv_slots=64, state_slots=2, deterministic=True))
    assert generate_greedy(runner, prompt, NEW_TOKENS) == hf_tokens
    step = batch(0, [req("a", prompt, 0, list(range(1, len(prompt) + 1)), 1)], clears=[1])
    ours = forward_all_logits(runner, step)["a"]
    assert float((ours - hf_logits).abs().max()) <= LOGIT_TOL * float(hf_logits.abs().max())


def test_an_existing_checkpoint_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        write_transformers(str(tmp_path / "full"), "lfm2-1.2b", num_layers=2, fields=TINY["lfm2-1.2b"])


def test_bench_peers_writes_a_family_shape_once_in_transformers_layout(tmp_path: Path, monkeypatch) -> None:
    """bench_peers --model SHAPE: the shape's checkpoint is written in the transformers layout into the cache
    folder once and reused; a cache folder holding another model is refused."""
    pytest.importorskip("transformers")
    from benchmarks import make_family_model
    from benchmarks.bench_peers import parse_args
    from benchmarks.peers_model import peers_checkpoint, shape_dir
    from benchmarks.peers_procs import PeerError

    tiny = truncate(dict(make_family_model.SHAPES["lfm2-1.2b"], **TINY["lfm2-1.2b"]), 2)
    monkeypatch.setitem(make_family_model.SHAPES, "tiny-lfm2", tiny)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert parse_args(["--model", "tiny-lfm2"]).model == "tiny-lfm2"
    path = peers_checkpoint("tiny-lfm2", "bfloat16")
    assert Path(path) == shape_dir("tiny-lfm2", "bfloat16") and Path(path).is_relative_to(tmp_path)
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert cfg["architectures"] == ["Lfm2ForCausalLM"] and cfg["dtype"] == "bfloat16"
    assert (Path(path) / "tokenizer.json").is_file()
    written = os.stat(Path(path) / "model.safetensors").st_mtime_ns
    assert peers_checkpoint("tiny-lfm2", "bfloat16") == path  # reused, not written again
    assert os.stat(Path(path) / "model.safetensors").st_mtime_ns == written
    monkeypatch.setitem(make_family_model.SHAPES, "tiny-lfm2", dict(tiny, hidden_size=128))
    with pytest.raises(PeerError, match="hidden_size"):
        peers_checkpoint("tiny-lfm2", "bfloat16")
    assert peers_checkpoint(str(tmp_path), "bfloat16") == str(tmp_path)  # a directory is served as it is
