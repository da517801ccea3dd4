"""The gathered expert product (`hyssm_cpu.expert_product`, GemmSite.apply_gathered): every routing choice's
row times the matrix of the expert it chose (an int8 stack's with its row scales), equal to the per-expert
products within float32 rounding, in choice order, whether rows are per token or per choice, experts chosen
twice or not at all; bad input named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_proc.kernels import native
from worker_proc.quant.weight import quantize_int8

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")


def _expected(x: torch.Tensor, stack: torch.Tensor, idx: torch.Tensor, per_choice: bool) -> torch.Tensor:
    k = idx.shape[1]
    rows = [x[c if per_choice else c // k].float() @ stack[int(e)].float().T for c, e in enumerate(idx.flatten())]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sequential", [False, True])
@pytest.mark.parametrize("per_choice", [False, True])
def test_each_choice_gets_its_experts_product(dtype: torch.dtype, sequential: bool, per_choice: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    experts, out, width, tokens, k = 9, 70, 100, 11, 3  # widths off every vector and block size
    stack = torch.randn(experts, out, width, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    idx[3] = idx[2]  # two tokens on the same experts; some experts chosen by nobody
    idx[idx == 5] = 4
    x = torch.randn(tokens * k if per_choice else tokens, width, generator=gen).to(dtype)
    got = torch.ops.hyssm_cpu.expert_product(x, stack, None, idx, per_choice, sequential)
    want = _expected(x, stack, idx, per_choice)
    assert got.shape == (tokens * k, out) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * float(want.abs().max())
    assert float((got.float() - want).abs().max()) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_stack_is_read_with_its_row_scales(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    q = quantize_int8(torch.randn(5, 40, 72, generator=gen))
    x, idx = torch.randn(4, 72, generator=gen).to(dtype), torch.tensor([[1, 3], [3, 0], [4, 1], [1, 2]])
    got = torch.ops.hyssm_cpu.expert_product(x, q.data, q.scale, idx, False, True)
    want = _expected(x, q.data.float() * q.scale[..., None], idx, False)
    assert got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * float(want.abs().max())
    assert float((got.float() - want).abs().max()) <= tol
    with pytest.raises(RuntimeError, match="needs float32 scales"):
        torch.ops.hyssm_cpu.expert_product(x, q.data, None, idx, False, True)


def test_one_token_equals_the_few_row_product_of_its_experts() -> None:
    gen = torch.Generator().manual_seed(2)
    stack = torch.randn(6, 48, 64, generator=gen)
    x, idx = torch.randn(1, 64, generator=gen), torch.tensor([[4, 0, 2]])
    got = torch.ops.hyssm_cpu.expert_product(x, stack, None, idx, False, True)
    for j, e in enumerate((4, 0, 2)):
        assert torch.allclose(got[j], F.linear(x, stack[e])[0], atol=1e-5)
        assert torch.equal(got[j], torch.ops.hyssm_cpu.gemv_seq(x, stack[e], None)[0])


def test_bad_input_is_named() -> None:
    stack, x = torch.randn(4, 8, 16), torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="expert 4 of 4"):
        torch.ops.hyssm_cpu.expert_product(x, stack, None, torch.tensor([[0, 4], [1, 2]]), False, True)
    with pytest.raises(RuntimeError, match="3 rows for 2 tokens"):
        torch.ops.hyssm_cpu.expert_product(torch.randn(3, 16), stack, None, torch.tensor([[0, 1], [1, 2]]), False, True)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.hyssm_cpu.expert_product(x.bfloat16(), stack, None, torch.tensor([[0, 1], [1, 2]]), False, True)
    with pytest.raises(RuntimeError, match="each expert must be contiguous"):
        torch.ops.hyssm_cpu.expert_product(x, torch.randn(4, 16, 8).transpose(1, 2), None,
                                           torch.tensor([[0, 1], [1, 2]]), False, True)
