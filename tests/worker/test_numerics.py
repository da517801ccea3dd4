"""Denormal hygiene (worker_proc.host.numerics): with weights initialised by transformers' own init, no
subnormal value reaches a matrix product of a prefill step (counted at every GEMM-like aten op), on
every intra-op thread; without the flush the same step feeds them millions, so the count can fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker_proc.host.numerics import flush_subnormal_, subnormal_count

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "rope_moe"

PROBE = r"""
import json, sys, random
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from shared.messages import ForwardBatch, ReqSlice, SamplingParams
from worker_proc.host.numerics import flush_denormals, subnormal_count
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

GEMMS = ("mm", "bmm", "addmm", "baddbmm", "_linear_pointwise", "linear", "matmul")

class CountSubnormals(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.ops = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in GEMMS:
            self.ops += 1
            for a in args:
                if isinstance(a, torch.Tensor) and a.layout == torch.strided and not a.is_mkldnn:
                    self.count += subnormal_count(a)
        return func(*args, **(kwargs or {}))

torch.set_num_threads(2)
assert flush_denormals()  # as the worker process does, before any parallel region
runner = ModelRunner(sys.argv[1], WorkerConfig(kv_slots=300, state_slots=4, thread_options=(2,), kernels=sys.argv[2]))
ids = [random.Random(0).randrange(3, 300) for _ in range(256)]

def prefill(step):
    sl = ReqSlice(rid=f"r{step}", input_ids=ids, start_pos=0, kv_slots=list(range(1, 257)), state_slot=1,
                  sample=True, sampling=SamplingParams(temperature=0.0))
    mode = CountSubnormals()
    with mode:
        runner.step(ForwardBatch(step=step, reqs=[sl], clears=[1]))
    return mode

flushed = prefill(1)
torch.set_num_threads(1)  # the main thread alone: its mode is the one switched off below
torch.set_flush_denormal(False)
unflushed = prefill(2)
print(json.dumps({"flushed": flushed.count, "ops": flushed.ops, "unflushed": unflushed.count}))
"""


def _transformers_checkpoint(out: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg.update(hidden_size=256, mamba_chunk_size=64, mamba_n_heads=16, mamba_d_head=32)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(out))
    model.save_pretrained(out)


@pytest.mark.parametrize("kernels", ["fast", "native"])
def test_no_subnormal_reaches_a_product_with_transformers_initialised_weights(tmp_path: Path, kernels: str) -> None:
    """`fast`'s chunked scan multiplies decay matrices, where the subnormals arise unflushed; the fused
    `native` scan has no product there, so only the flushed count is its to meet."""
    ckpt = tmp_path / "tf-init"
    _transformers_checkpoint(ckpt)
    out = subprocess.run([sys.executable, "-c", PROBE, str(ckpt), kernels], cwd=REPO, capture_output=True,
                         text=True, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["ops"] > 0
    assert counts["flushed"] == 0
    if kernels == "fast":
        assert counts["unflushed"] > 1000  # the same step without the flush: the probe sees them


def test_subnormal_weights_are_zeroed_at_load() -> None:
    """Subnormals are found by their bits (with denormals-are-zero on, a float comparison sees zero)."""
    layer = torch.nn.Linear(4, 4).requires_grad_(False)
    tiniest = torch.tensor([1, (1 << 22) - (1 << 31)], dtype=torch.int32).view(torch.float32)  # two subnormals
    layer.weight.fill_(0.5)
    layer.weight[0, :2] = tiniest
    layer.bias.copy_(tiniest.repeat(2))
    assert subnormal_count(layer.weight) == 2 and subnormal_count(layer.bias) == 4
    assert subnormal_count(torch.tensor([1, 1 << 7], dtype=torch.int16).view(torch.bfloat16)) == 1
    assert subnormal_count(torch.zeros(3)) == 0
    assert flush_subnormal_(layer) == 6
    assert subnormal_count(layer.weight) == 0 and layer.weight[0, 0].item() == 0.0
    assert layer.weight[1, 1].item() == 0.5


def test_a_large_weight_is_flushed_block_by_block_with_every_subnormal_found() -> None:
    """A tensor over several of flush_subnormal_'s blocks (the last one partial) and a non-contiguous
    one: every subnormal is zeroed, in every block, and nothing else changes."""
    from worker_proc.host.numerics import FLUSH_BLOCK_ELEMENTS

    module = torch.nn.Module()
    big = torch.full((5, FLUSH_BLOCK_ELEMENTS // 2 + 3), 0.25, dtype=torch.bfloat16)
    tiny = torch.tensor([1], dtype=torch.int16).view(torch.bfloat16)
    planted = [0, FLUSH_BLOCK_ELEMENTS - 1, FLUSH_BLOCK_ELEMENTS, big.numel() - 1]
    big.view(-1)[planted] = tiny
    module.big = torch.nn.Parameter(big, requires_grad=False)
    module.register_buffer("strided", torch.full((6, 4), 0.5).t())
    module.strided[1, 2] = torch.tensor([1], dtype=torch.int32).view(torch.float32)
    assert not module.strided.is_contiguous()
    assert flush_subnormal_(module) == len(planted) + 1
    assert subnormal_count(module.big) == 0 and subnormal_count(module.strided) == 0
    assert (module.big.view(-1)[planted] == 0).all() and int((module.big == 0.25).sum()) == big.numel() - len(planted)
    assert module.strided[1, 2].item() == 0.0 and int((module.strided == 0.5).sum()) == 23
