"""Pre-quantized checkpoints (worker_proc.loading.prequantized) against transformers loading the same files.

Checkpoints are written at test time from the parity fixtures (tests/fixtures/make_prequant.py):
compressed-tensors' own writer for its formats, the tensors directly for the block-fp8 layout. For
each, hyssm on the `dequant_*` reference products gives transformers' logits (its dequantized model,
float32) within 1e-4 and the same greedy tokens; the measured plan's products stay as close as
tests/worker/test_quantized_models.py holds them. transformers' compressed-tensors integration
dequantizes on the CPU; its FP8 loader does too, but derives the block size from the scale grid
(wrong for a partial last block), so a block-fp8 checkpoint with partial blocks is compared with
transformers running its dequantized dense copy instead. The same at TP=2 (gloo).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.fixtures.make_prequant import write_compressed, write_dequantized, write_fp8_block
from tests.model_driver import forward_all_logits, forward_logits, generate_greedy
from tests.tp.harness import run_ranks
from tests.worker.test_quantized_models import REFERENCE
from tests.worker.util import batch, reference, req
from worker_proc.linear.kernels import DEQUANT
from worker_proc.plan.execution_plan import fixed_plan, product_sites
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("accelerate")  # transformers' FP8 loader needs it

pytestmark = pytest.mark.timeout(300)

TOL = 1e-4
PRODUCT_TOL = 2e-2
"""A measured product against its format's reference, relative (test_quantization's bound for w8a8)."""
MEDIAN_COSINE = 0.95
"""The measured plan's logit rows against the reference's: the fixtures are random, and one routing
flip (per-row int8 activations flip a top-2 choice here) decorrelates the rows after it, so the typical
row is held to its direction and every product to PRODUCT_TOL."""
G = torch.Generator().manual_seed(5)
N_NEW = 6
TP_IGNORE = ["re:.*down_proj$", r"re:.*shared_mlp\.output_linear$"]
"""Inputs 96 and 32 split over 2 ranks cut a 32-input group (refused: test_a_split_cutting_a_group...)."""

# name: (fixture, how, options); how: a compressed-tensors preset or "fp8_block"
CHECKPOINTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "granite_w4a16": ("rope_moe", "W4A16", {"group": 32}),
    "granite_w4a16_asym": ("rope_moe", "W4A16_ASYM", {"group": 32}),
    "granite_w8a8": ("rope_moe", "W8A8", {}),
    "granite_fp8_dynamic": ("rope_moe", "FP8_DYNAMIC", {}),
    "granite_fp8_static": ("rope_moe", "FP8", {}),
    "granite_fp8_block": ("rope_moe", "fp8_block", {"block": (128, 128)}),
    "qwen_w4a16": ("qwen3_5_dense", "W4A16", {"group": 32}),
    # compressed-tensors cannot decompress the zero points of a module with fewer than 9 rows
    "qwen_w4a16_asym": ("qwen3_5_dense", "W4A16_ASYM", {"group": 32, "ignore": [r"re:.*in_proj_[ab]$"]}),
    "qwen_w8a8": ("qwen3_5_dense", "W8A8", {}),
    "qwen_fp8_block": ("qwen3_5_dense", "fp8_block", {"block": (32, 32), "pow2": True}),
    "qwen_moe_fp8_block": ("qwen3_5_moe", "fp8_block", {"block": (128, 128)}),
    "granite_w4a16_tp": ("rope_moe", "W4A16_ASYM", {"group": 32, "ignore": TP_IGNORE}),
    "qwen_w4a16_tp": ("qwen3_5_dense", "W4A16", {"group": 32, "ignore": TP_IGNORE}),
}
TRANSFORMERS_READS_FP8 = ("qwen_fp8_block",)
"""Block-fp8 checkpoints without partial blocks: transformers' own FP8 loader reads them."""
FORMAT = {"W4A16": "int4", "W4A16_ASYM": "int4", "W8A8": "int8", "FP8_DYNAMIC": "fp8", "FP8": "fp8",
          "fp8_block": "fp8"}


def _write(name: str, root: str) -> tuple[str, str]:
    """(checkpoint dir, the dir transformers loads as its reference)."""
    fixture, how, opts = CHECKPOINTS[name]
    out = os.path.join(root, name)
    if how == "fp8_block":
        write_fp8_block(fixture, out, opts["block"], opts.get("pow2", False))
        if name in TRANSFORMERS_READS_FP8:
            return out, out
        return out, write_dequantized(out, out + "_dense")
    write_compressed(fixture, out, how, opts.get("group", 0), opts.get("ignore", ()))
    return out, out


def _transformers_reference(model_dir: str, prompt: list[int]) -> dict[str, Any]:
    """transformers' dequantized float32 model: prompt logits and greedy tokens (full forwards)."""
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if "compressed-tensors" in open(os.path.join(model_dir, "config.json")).read():
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()
    ids = list(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
        tokens = []
        for _ in range(N_NEW):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            tokens.append(tok)
            ids.append(tok)
    return {"logits": logits, "tokens": tokens}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("prequant"))
    out = {}
    for name, (fixture, _, _) in CHECKPOINTS.items():
        path, ref_dir = _write(name, root)
        prompt = reference(fixture)["prompt"].tolist()
        out[name] = {"path": path, "prompt": prompt, **_transformers_reference(ref_dir, prompt)}
    return out


def _prompt_logits(r: ModelRunner, prompt: list[int]) -> torch.Tensor:
    kv = list(range(1, len(prompt) + 1))
    return forward_all_logits(r, batch(0, [req("a", prompt, 0, kv, 1)], clears=[1]))["a"]


@pytest.mark.parametrize("name", [n for n in CHECKPOINTS if not n.endswith("_tp")])
def test_the_checkpoint_gives_transformers_dequantized_model(name: str, checkpoints: dict) -> None:
    ck = checkpoints[name]
    prompt = ck["prompt"]
    r = ModelRunner(ck["path"], WorkerConfig(kv_slots=len(prompt) + N_NEW + 2, state_slots=4, dtype="float32"))
    fmt = FORMAT[CHECKPOINTS[name][1]]
    held = {site.storage_format for _, site, _ in product_sites(r.model)}
    assert fmt in held and held <= {"dense", fmt}
    r.check_integrity()
    measured = _prompt_logits(r, prompt)
    measured_methods = {id(site): site.methods for _, site, _ in product_sites(r.model)}
    r.bind_plan(fixed_plan(r.model, REFERENCE))
    got = _prompt_logits(r, prompt)
    err = float((got - ck["logits"]).abs().max())
    assert err <= TOL, f"{name}: logits {err:.2e} from transformers'"
    assert generate_greedy(r, prompt, N_NEW) == ck["tokens"]
    cosine = torch.nn.functional.cosine_similarity(measured, got, dim=-1)
    assert float(cosine.median()) >= MEDIAN_COSINE, f"{name}: measured plan's logit rows {cosine.tolist()}"
    for _, site, weight in product_sites(r.model):
        q = site.quantized
        if q is not None:
            q = q[0] if q.experts else q
            x = torch.randn(7, site.shape[1], generator=G)
            want = DEQUANT[site.storage_format].apply(x, weight, q, None)
            for method in measured_methods[id(site)]:
                err = float((method.apply(x, weight, q, None) - want).abs().max() / want.abs().max())
                assert err <= PRODUCT_TOL, f"{name}: {method.name} {err:.2e} from its reference"


def _rank_logits(rank: int, size: int, group: Any, jobs: list[tuple[str, str, list[int]]]) -> dict[str, Any]:
    out = {}
    for name, path, prompt in jobs:
        r = ModelRunner(
            path,
            WorkerConfig(dtype="float32", kv_slots=len(prompt) + N_NEW + 2, state_slots=4, tp_rank=rank, tp_size=size),
            tp_group=group,
        )
        r.bind_plan(fixed_plan(r.model, REFERENCE))
        out[name] = (_prompt_logits(r, prompt).numpy(), _greedy(r, prompt))
    return out


def _greedy(r: ModelRunner, prompt: list[int]) -> list[int]:
    """Greedy tokens from this rank's own logits (every rank runs every step, as a scheduler drives them)."""
    n = len(prompt)
    kv = list(range(1, n + N_NEW + 1))
    logits = forward_logits(r, batch(1, [req("g", prompt, 0, kv[:n], 2)], clears=[2]))["g"]
    tokens: list[int] = []
    for i in range(N_NEW):
        tokens.append(int(logits.argmax()))
        logits = forward_logits(r, batch(2 + i, [req("g", tokens[-1:], n + i, kv[: n + i + 1], 2)]))["g"]
    return tokens


TP_CHECKPOINTS = ("granite_w4a16_tp", "qwen_w4a16_tp", "granite_w8a8", "granite_fp8_block", "qwen_fp8_block")
"""(qwen3_5_moe has one key head: not splittable over 2 ranks.)"""


def test_tensor_parallel_ranks_give_transformers_dequantized_model(checkpoints: dict) -> None:
    jobs = [(n, checkpoints[n]["path"], checkpoints[n]["prompt"]) for n in TP_CHECKPOINTS]
    ranks = run_ranks(_rank_logits, 2, (jobs,), timeout=240)
    for name in TP_CHECKPOINTS:
        for rank, result in enumerate(ranks):
            err = float((torch.from_numpy(result[name][0]) - checkpoints[name]["logits"]).abs().max())
            assert err <= TOL, f"{name} rank {rank}: logits {err:.2e} from transformers'"
        assert ranks[0][name][1] == ranks[1][name][1] == checkpoints[name]["tokens"], name
