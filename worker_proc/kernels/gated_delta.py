"""The gated delta rule (Gated DeltaNet layers of Qwen3-Next / Qwen3.5) in pure torch: the chunked
form for prefill (initial and final state), the single-step update for decode, and a token-by-token
recurrence that is the definition both are tested against.

Per value head, with state S [Dk, Dv] (float32), decay g_t <= 0 (log space), beta_t in (0, 1),
q_t, k_t [Dk] (already L2-normalised; q is multiplied by `scale` here) and v_t [Dv]:

    S  <- exp(g_t) * S
    u_t = beta_t * (v_t - Sᵀ k_t)          (the delta: what the decayed state mispredicts)
    S  <- S + k_t u_tᵀ
    o_t = Sᵀ (scale * q_t)

Chunked form (chunks of C tokens, G_t = cumulative g inside the chunk, S0 the state entering it):
    (I + A) U = beta V - (beta exp(G) K) S0,   A[t, s] = beta_t exp(G_t - G_s) k_t·k_s for s < t
    O = (exp(G) Q) S0 + (Q Kᵀ ⊙ exp(G_t - G_s), s <= t) U
    S_C = exp(G_C) S0 + (K ⊙ exp(G_C - G))ᵀ U
The unit lower-triangular systems of every chunk are solved at once; only the state passing is
sequential. The last chunk is zero-padded (g = 0, beta = 0, k = 0: padded tokens leave the state
alone), so any length works and the result does not depend on the chunk size beyond rounding.

Shape letters: L tokens of one request, Bt requests of a decode group, H value heads (q/k already
expanded to one per value head), Dk key dim, Dv value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_SIZE = 64
"""The chunk of the prefill form (Qwen's and flash-linear-attention's)."""


def gated_delta_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                        initial_state: Tensor, chunk_size: int = CHUNK_SIZE) -> tuple[Tensor, Tensor]:  # fmt: skip
    """q, k: [L, H, Dk]; v: [L, H, Dv]; g, beta: [L, H]; initial_state: [H, Dk, Dv].
    Returns (o [L, H, Dv] float32, final state [H, Dk, Dv] float32)."""
    length, heads, dk = k.shape
    c = max(1, chunk_size)
    pad = (-length) % c
    n = (length + pad) // c

    def chunks(t: Tensor) -> Tensor:  # [L, H, ...] -> [n, H, C, ...] float32, zero-padded
        t = t.float()
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) if t.dim() > 1 else F.pad(t, (0, pad))
        return t.view(n, c, *t.shape[1:]).transpose(1, 2)

    qc, kc, vc = chunks(q) * scale, chunks(k), chunks(v)  # [n, H, C, D]
    gc, bc = chunks(g), chunks(beta)  # [n, H, C]
    cum = gc.cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [n, H, C, C]
    a = (kc @ kc.transpose(-1, -2)) * decay * bc[..., None]
    a = a.masked_fill(lower.logical_not().logical_or(torch.eye(c, dtype=torch.bool, device=q.device)), 0.0)
    eye = torch.eye(c, dtype=torch.float32, device=q.device)
    rhs = torch.cat([vc * bc[..., None], kc * (bc * cum.exp())[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
    u0, w = solved.split([vc.shape[-1], dk], dim=-1)  # U = u0 - w S0
    attn = (qc @ kc.transpose(-1, -2)) * decay  # [n, H, C, C]
    q_in = qc * cum.exp()[..., None]
    k_out = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()  # [n, H]
    state = initial_state.float()
    out = []
    for i in range(n):
        u = u0[i] - w[i] @ state
        out.append(q_in[i] @ state + attn[i] @ u)
        state = state * chunk_decay[i][:, None, None] + k_out[i].transpose(-1, -2) @ u
    o = torch.stack(out).transpose(1, 2).reshape(n * c, heads, vc.shape[-1])[:length]
    return o, state


def gated_delta_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     scale: float) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One token per request, batched. state: [Bt, H, Dk, Dv]; q, k: [Bt, H, Dk]; v: [Bt, H, Dv];
    g, beta: [Bt, H]. Returns (o [Bt, H, Dv] float32, new state [Bt, H, Dk, Dv] float32)."""
    # the decay in float64, rounded: float32 exp's SIMD and scalar tails differ in the last bit, which
    # would make a request's state depend on how many share the decode call
    s = state.float() * g.double().exp().float()[..., None, None]
    kf = k.float()
    pred = (s * kf[..., None]).sum(-2)  # Sᵀ k: [Bt, H, Dv]
    u = (v.float() - pred) * beta.float()[..., None]
    s = s + kf[..., None] * u[..., None, :]
    o = (s * (q.float() * scale)[..., None]).sum(-2)
    return o, s


def gated_delta_naive(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                      initial_state: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The definition, token by token (tests only): same arguments and results as `gated_delta_chunked`."""
    state = initial_state.float()[None]
    out = []
    for t in range(q.shape[0]):
        o, state = gated_delta_step(state, q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                    beta[t : t + 1], scale)  # fmt: skip
        out.append(o[0])
    return torch.stack(out) if out else v.new_zeros(0, *v.shape[1:]).float(), state[0]


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x * rsqrt(sum(x²) + eps) over the last dim, in float32 (Qwen's and flash-linear-attention's)."""
    xf = x.float()
    # the squares, their sum and the inverse norm in float64, rounded once: float32 SIMD and scalar
    # tails differ in the last bit, and which rows take which depends on how many rows there are
    xd = xf.double()
    return xf * torch.rsqrt((xd * xd).sum(-1, keepdim=True) + eps).float()
