"""Triton causal conv1d (prefill varlen + decode) against `reference.causal_conv1d[_step]`, interpreted."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.util import TOL, cu_seqlens, max_diff, pool, rand, strided, untouched
from worker_proc.kernels import reference as ref
from worker_proc.kernels.triton.conv import conv_decode, conv_prefill_varlen

CHANNELS = 70  # not a multiple of the kernel's 64/128-channel blocks


def _ref_prefill(x, cu, conv_pool, slots, weight, bias, silu=True):
    outs = []
    for r, slot in enumerate(slots):
        out, state = ref.causal_conv1d(x[cu[r] : cu[r + 1]], conv_pool[slot], weight, bias, silu)
        conv_pool[slot] = state
        outs.append(out)
    return torch.cat(outs)


@pytest.mark.parametrize("silu", [True, False])  # False: a short convolution's conv (LFM2)
@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize("with_bias", [True, False])
def test_prefill_ragged_batch(gen: torch.Generator, width: int, with_bias: bool, silu: bool) -> None:
    # lengths: 1 and 2 (< K-1: the new state keeps old columns), 37 (crosses the 32-token block), 5
    lengths, slots = [1, 2, 37, 5], [3, 1, 5, 2]
    cu = cu_seqlens(lengths)
    x = strided(rand(gen, cu[-1], CHANNELS))
    weight, bias = rand(gen, CHANNELS, width), rand(gen, CHANNELS) if with_bias else None
    conv = pool(gen, 6, CHANNELS, width - 1, zero=(1,))  # slot 1 starts from zeros, the others not
    mine = conv.clone()
    out = conv_prefill_varlen(
        x, torch.tensor(cu, dtype=torch.int32), max(lengths), mine, torch.tensor(slots), weight, bias, silu
    )
    expect = _ref_prefill(x, cu, conv, slots, weight, bias, silu)
    assert out.dtype == x.dtype and out.shape == expect.shape
    assert max_diff(out, expect) <= TOL
    assert max_diff(mine, conv) <= TOL
    assert untouched(conv, mine, slots) and not mine[0].any()


def test_prefill_half_precision(gen: torch.Generator) -> None:
    """bf16 inputs and pool: the kernel accumulates in fp32, the reference in bf16 -> bf16 tolerance."""
    lengths, slots = [9, 3], [2, 1]
    cu = cu_seqlens(lengths)
    x = rand(gen, cu[-1], CHANNELS, dtype=torch.bfloat16)
    weight, bias = rand(gen, CHANNELS, 4, dtype=torch.bfloat16), rand(gen, CHANNELS, dtype=torch.bfloat16)
    conv = pool(gen, 3, CHANNELS, 3, dtype=torch.bfloat16)
    mine = conv.clone()
    out = conv_prefill_varlen(x, torch.tensor(cu, dtype=torch.int32), 9, mine, torch.tensor(slots), weight, bias)
    expect = _ref_prefill(x, cu, conv, slots, weight, bias)
    assert out.dtype == torch.bfloat16
    assert max_diff(out, expect) <= 0.05 * float(expect.float().abs().max())
    assert torch.equal(mine, conv)  # the state is a copy of inputs: exact


@pytest.mark.parametrize("silu", [True, False])
def test_decode_with_padding_row(gen: torch.Generator, silu: bool) -> None:
    slots = torch.tensor([4, 0, 2, 1])  # row 1 is a padding row (slot 0): computed, never written
    x = strided(rand(gen, 4, CHANNELS))
    weight, bias = rand(gen, CHANNELS, 4), rand(gen, CHANNELS)
    conv = pool(gen, 5, CHANNELS, 3, zero=(1,))
    mine = conv.clone()
    out = conv_decode(x, mine, slots, weight, bias, silu)
    expect, new_state = ref.causal_conv1d_step(x, conv[slots], weight, bias, silu)
    assert max_diff(out, expect) <= TOL
    for row, slot in enumerate(slots.tolist()):
        if slot:
            assert max_diff(mine[slot], new_state[row]) <= TOL
    assert untouched(conv, mine, [4, 2, 1]) and not mine[0].any()


def test_prefill_then_decode_continues_the_same_state(gen: torch.Generator) -> None:
    """A prompt split as prefill(6) + 3 decode steps equals one reference conv over all 9 tokens."""
    x = rand(gen, 9, CHANNELS)
    weight, bias = rand(gen, CHANNELS, 4), rand(gen, CHANNELS)
    conv = pool(gen, 2, CHANNELS, 3, zero=(2,))
    mine = conv.clone()
    slot = torch.tensor([2])
    outs = [conv_prefill_varlen(x[:6], torch.tensor([0, 6], dtype=torch.int32), 6, mine, slot, weight, bias)]
    for t in range(6, 9):
        outs.append(conv_decode(x[t : t + 1], mine, slot, weight, bias))
    expect, state = ref.causal_conv1d(x, conv[2], weight, bias)
    assert max_diff(torch.cat(outs), expect) <= TOL
    assert max_diff(mine[2], state) <= TOL
