"""Kimi Delta Attention: the per-channel gated delta rule's chunked form against its token-by-token
definition (several chunks, a carried state, uneven tails) and against Gated DeltaNet's rule where the
decay is the same on every channel; the mixer against transformers' KimiLinearDeltaAttention on random
inputs (a prefill from a fresh state, then decode steps from the pooled conv windows and state); the
kernel set's choice of the KDA backend (flash-linear-attention's only on CUDA)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from shared.model_config import Block, HybridConfig, KdaConfig, Sublayer
from worker_proc.kernels.gated_delta import gated_delta_chunked, l2_normalize
from worker_proc.kernels.kda_ops import ReferenceKda, kda_choice
from worker_proc.kernels.kimi_delta import kda_chunked, kda_naive
from worker_proc.kernels.reference_ops import ReferenceOps
from worker_proc.model.batch import DecodeGroup, PrefillSeg, StepBatch
from worker_proc.model.kimi_delta import KimiDeltaAttention
from worker_proc.model.shard import TPInfo
from worker_proc.plan.kernel_set import choose_kernels


def _inputs(length: int, heads: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(length, heads, dk, generator=gen))
    k = l2_normalize(torch.randn(length, heads, dk, generator=gen))
    v = torch.randn(length, heads, dv, generator=gen)
    g = -torch.rand(length, heads, dk, generator=gen) * 1.5
    beta = torch.rand(length, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("length,chunk", [(1, 32), (31, 8), (70, 32), (64, 16)])
def test_chunked_equals_the_definition(length: int, chunk: int) -> None:
    q, k, v, g, beta, state = _inputs(length, 3, 8, 5, seed=length)
    o, final = kda_chunked(q, k, v, g, beta, 0.4, state, chunk)
    o_ref, final_ref = kda_naive(q, k, v, g, beta, 0.4, state)
    assert (o - o_ref).abs().max() <= 1e-5 and (final - final_ref).abs().max() <= 1e-5


def test_a_decay_equal_on_every_channel_is_gated_deltanets_rule() -> None:
    q, k, v, g, beta, state = _inputs(45, 2, 8, 6, seed=3)
    scalar = g[..., 0]
    o, final = kda_chunked(q, k, v, scalar[..., None].expand_as(g), beta, 0.3, state)
    o_gdn, final_gdn = gated_delta_chunked(q, k, v, scalar, beta, 0.3, state)
    assert (o - o_gdn).abs().max() <= 1e-5 and (final - final_gdn).abs().max() <= 1e-5
    o_chan, _ = kda_chunked(q, k, v, g, beta, 0.3, state)
    assert (o_chan - o).abs().max() > 1e-3  # the per-channel decay is not ignored


def _cfg(heads: int, head_dim: int, d_conv: int) -> HybridConfig:
    return HybridConfig(
        architecture="KimiLinearForCausalLM", vocab_size=10, hidden_size=32, layer_kinds=("kda",), rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=False, torch_dtype="float32",
        layer_specs=((Sublayer("input_layernorm", (Block("kda", "self_attn"),)),),),
        kda=KdaConfig(heads=heads, head_dim=head_dim, d_conv=d_conv),
    )


def _prefill(rows: int, slot: int) -> StepBatch:
    t = torch.arange(rows)
    seg = PrefillSeg(0, rows, 0, torch.zeros(rows, dtype=torch.int64), slot)
    return StepBatch(t, t, t, (seg,), (), t[-1:], ("a",))


def _decode(slot: int) -> StepBatch:
    one = torch.tensor([0])
    group = DecodeGroup(one, torch.tensor([slot]), torch.zeros(1, 1, dtype=torch.int64), torch.tensor([1]))
    return StepBatch(one, one, one, (), (group,), one, ("a",))


def test_mixer_against_transformers_prefill_then_decode() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    heads, head_dim, d_conv, length, steps = 3, 8, 4, 23, 4
    hf_cfg = transformers.KimiLinearConfig(hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"],
                                           linear_attn_config=dict(num_heads=heads, head_dim=head_dim,
                                                                   short_conv_kernel_size=d_conv))  # fmt: skip
    torch.manual_seed(5)
    hf = KimiLinearDeltaAttention(hf_cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.dim() > 1 else 0.5))
        hf.forget_gate.A_log.copy_(torch.log(torch.rand(hf.forget_gate.A_log.shape) * 2 + 0.2))
    ours = KimiDeltaAttention(_cfg(heads, head_dim, d_conv), torch.float32, torch.device("cpu"), TPInfo())
    renamed = {k.replace("forget_gate.", ""): v for k, v in hf.state_dict().items()}
    # transformers holds the three convs as one (q | k | v channels); a checkpoint stores them apart
    for name, taps in zip("qkv", renamed.pop("conv1d.weight").chunk(3), strict=True):
        renamed[f"{name}_conv1d.weight"] = taps
    ours.load_state_dict(renamed)
    x = torch.randn(1, length + steps, 32)
    with torch.no_grad():
        expected = hf(x)[0]
    conv_pool = torch.zeros(3, 3 * heads * head_dim, d_conv - 1)
    state_pool = torch.zeros(3, heads, head_dim, head_dim)
    ops = ReferenceOps()
    with torch.no_grad():
        got = [ours(x[0, :length], _prefill(length, 2), conv_pool, state_pool, ops)]
        got += [ours(x[0, i : i + 1], _decode(2), conv_pool, state_pool, ops) for i in range(length, length + steps)]
    assert (torch.cat(got) - expected).abs().max() <= 1e-5
    assert not state_pool[1].any() and not conv_pool[1].any()  # only the given slot moved
    assert state_pool[2].abs().sum() > 0


def test_the_fla_backend_is_chosen_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kda_choice("cpu") == "reference"
    choice = choose_kernels("cpu", "reference", has_gdn=False, has_kda=True)
    assert choice.kda == "reference" and isinstance(choice.build().kda, ReferenceKda)
    assert choose_kernels("cpu", "reference", has_gdn=False).kda == ""
    fla = types.ModuleType("fla")
    fla_ops = types.ModuleType("fla.ops")
    fla_kda = types.ModuleType("fla.ops.kda")
    monkeypatch.setitem(sys.modules, "fla", fla)
    monkeypatch.setitem(sys.modules, "fla.ops", fla_ops)
    monkeypatch.setitem(sys.modules, "fla.ops.kda", fla_kda)
    assert kda_choice("cuda") == "fla"  # importable on CUDA: the library's kernels
    assert kda_choice("cpu") == "reference"  # never off CUDA
