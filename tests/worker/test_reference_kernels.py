"""Reference kernels against naive token-by-token definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_proc.kernels import ReferenceOps
from worker_proc.kernels import reference as ref
from worker_proc.kernels.interface import SsdParams
from worker_proc.plan.kernel_set import select_ops

G = torch.Generator().manual_seed(0)


def _rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=G) * scale


def _naive_ssd(x, dt, a, b, c, d, state):
    heads = x.shape[1]
    b = b.repeat_interleave(heads // b.shape[1], dim=1)
    c = c.repeat_interleave(heads // c.shape[1], dim=1)
    ys = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * a)[:, None, None]
        state = state * decay + (dt[t][:, None] * x[t])[..., None] * b[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, c[t]) + x[t] * d[:, None])
    return torch.stack(ys), state


def _ssd_inputs(length: int, heads: int = 4, p: int = 3, groups: int = 2, n: int = 5):
    x = _rand(length, heads, p)
    dt = F.softplus(_rand(length, heads) - 1.0)
    a = -torch.rand(heads, generator=G) * 2 - 0.1
    b, c = _rand(length, groups, n), _rand(length, groups, n)
    d = _rand(heads)
    return x, dt, a, b, c, d


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (8, 4), (13, 5), (20, 64)])
@pytest.mark.parametrize("zero_init", [True, False])
def test_ssd_chunk_scan_matches_recurrence(length: int, chunk: int, zero_init: bool) -> None:
    x, dt, a, b, c, d = _ssd_inputs(length)
    init = torch.zeros(4, 3, 5) if zero_init else _rand(4, 3, 5)
    y, final = ref.ssd_chunk_scan(x, dt, a, b, c, d, chunk, init)
    y_ref, final_ref = _naive_ssd(x, dt, a, b, c, d, init)
    assert (y - y_ref).abs().max() < 1e-4 and (final - final_ref).abs().max() < 1e-4


def test_ssd_states_at_positions() -> None:
    x, dt, a, b, c, d = _ssd_inputs(17)
    init = _rand(4, 3, 5)
    y, final, states = ref.ssd_chunk_scan_with_states(x, dt, a, b, c, d, 4, init, (3, 9, 17))
    y_ref, final_ref = _naive_ssd(x, dt, a, b, c, d, init)
    assert (y - y_ref).abs().max() < 1e-4 and (final - final_ref).abs().max() < 1e-4
    for pos, s in zip((3, 9, 17), states, strict=True):
        _, s_ref = _naive_ssd(x[:pos], dt[:pos], a, b[:pos], c[:pos], d, init)
        assert (s - s_ref).abs().max() < 1e-4
    with pytest.raises(ValueError):
        ref.ssd_chunk_scan_with_states(x, dt, a, b, c, d, 4, init, (9, 3))


def test_ssd_state_step_matches_recurrence() -> None:
    x, dt, a, b, c, d = _ssd_inputs(3)  # three requests, one token each
    state = _rand(3, 4, 3, 5)
    y, new = ref.ssd_state_step(state, x, dt, a, b, c, d)
    for i in range(3):
        y_ref, s_ref = _naive_ssd(x[i : i + 1], dt[i : i + 1], a, b[i : i + 1], c[i : i + 1], d, state[i])
        assert (y[i] - y_ref[0]).abs().max() < 1e-5 and (new[i] - s_ref).abs().max() < 1e-5


def test_dt_limit_clamps() -> None:
    dt = torch.tensor([[-5.0, 0.0, 5.0]])
    out = ref.discretize_dt(dt, torch.zeros(3), (0.1, 2.0))
    assert out.min() >= 0.1 and out.max() <= 2.0
    assert torch.allclose(ref.discretize_dt(dt, torch.zeros(3), (0.0, float("inf"))), F.softplus(dt))


def test_conv_prefill_continues_and_matches_steps() -> None:
    cd, k, length = 6, 4, 9
    x, w, bias = _rand(length, cd), _rand(cd, k), _rand(cd)
    state0 = _rand(cd, k - 1)
    out, state = ref.causal_conv1d(x, state0, w, bias)
    # token by token through the decode step
    s = state0[None]
    for t in range(length):
        o, s = ref.causal_conv1d_step(x[t : t + 1], s, w, bias)
        assert (o[0] - out[t]).abs().max() < 1e-5
    assert torch.allclose(s[0], state)
    # a prompt shorter than the kernel keeps part of the old state
    _, state2 = ref.causal_conv1d(x[:1], state0, w, bias)
    assert torch.equal(state2, torch.cat([state0[:, 1:], x[:1].t()], dim=-1))


def test_attention_prefill_decode_agree() -> None:
    total, heads, kvh, dim = 10, 4, 2, 8
    q, k, v = _rand(total, heads, dim), _rand(total, kvh, dim), _rand(total, kvh, dim)
    full = ref.attention_prefill(q, k, v, 0, 0.3)
    tail = ref.attention_prefill(q[6:], k, v, 6, 0.3)  # continuing a cached 6-token prefix
    assert (tail - full[6:]).abs().max() < 1e-5
    lengths = torch.tensor([10, 4])
    kpad = torch.stack([k, torch.cat([k[:4], torch.zeros(6, kvh, dim)])])
    vpad = torch.stack([v, torch.cat([v[:4], torch.full((6, kvh, dim), float("nan"))])])
    dec = ref.attention_decode(torch.stack([q[9], q[3]]), kpad, vpad, lengths, 0.3)
    assert (dec[0] - full[9]).abs().max() < 1e-5 and (dec[1] - full[3]).abs().max() < 1e-5


@pytest.mark.parametrize("invariant", [True, False])
def test_ops_write_only_their_slots(invariant: bool) -> None:
    ops = ReferenceOps(batch_invariant=invariant)
    heads, p, n, cd, k = 4, 3, 5, 6, 4
    ssm = torch.zeros(5, heads, p, n)
    conv = torch.zeros(5, cd, k - 1)
    x, dt, a, b, c, d = _ssd_inputs(2)
    ops.ssd_decode(x, dt, b, c, SsdParams(a, d, torch.zeros(heads), (0.0, float("inf")), 4), ssm, torch.tensor([3, 1]))
    ops.conv_decode(_rand(2, cd), conv, torch.tensor([3, 1]), _rand(cd, k), None)
    for pool in (ssm, conv):
        assert pool[1].any() and pool[3].any() and not pool[0].any() and not pool[2].any() and not pool[4].any()
    kp, vp = _rand(8, 2, 4), _rand(8, 2, 4)
    kp[0] = vp[0] = 0
    q = _rand(2, 4, 4)
    idx = torch.tensor([[5, 6, 7], [2, 0, 0]])
    out = ops.attn_decode(q, kp, vp, idx, torch.tensor([3, 1]), 0.5)
    alone = ops.attn_prefill(q[1:], kp, vp, torch.tensor([2]), 0, 0.5)
    assert (out[1] - alone[0]).abs().max() < 1e-6
    det = select_ops("cpu", deterministic=True)
    assert isinstance(det, ReferenceOps) and det.batch_invariant
