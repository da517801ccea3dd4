"""Parity with transformers where the fused prefill attention runs: the parity fixtures' heads are
narrower than the kernel takes, so this checkpoint widens a Granite-4.0-H fixture's attention heads
to 64 (the 350M model's width) and is prefilled in chunks that cross the kernel's blocks of keys and
queries, over scattered KV slots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.worker.util import chunked_prompt_logits, max_diff, runner_at
from worker_proc.kernels import FastOps, native

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "rope_moe"
TOL = 1e-4


def _wide_head_checkpoint(out: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=64,
               mamba_chunk_size=64, max_position_embeddings=1024)  # fmt: skip
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (FIXTURE / name).exists():
            (out / name).write_bytes((FIXTURE / name).read_bytes())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(out)).eval()
    model.save_pretrained(out)
    return model


def test_chunked_prefill_through_fused_attention_matches_transformers(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fallback(*args: object) -> None:
        raise AssertionError("the fast kernels' prefill attention ran instead of the fused one")

    monkeypatch.setattr(FastOps, "attn_prefill", no_fallback)
    model = _wide_head_checkpoint(tmp_path / "wide")
    prompt = torch.randint(3, 300, (230,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0]
    r = runner_at(str(tmp_path / "wide"), kv_slots=512, state_slots=4, kernels="native")
    assert r.ops.name == "native"
    assert max_diff(chunked_prompt_logits(r, prompt, (70, 1, 95, 64)), want) <= TOL
    r.check_integrity()
