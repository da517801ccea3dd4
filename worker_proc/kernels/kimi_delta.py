"""The gated delta rule with a per-channel decay (Kimi Delta Attention, Kimi Linear) in pure torch:
the chunked form for prefill (initial and final state), the single-step update for decode, and a
token-by-token recurrence that is the definition both are tested against.

Per head, with state S [Dk, Dv] (float32), decay g_t [Dk] <= 0 (log space, one per key channel),
beta_t in (0, 1), q_t, k_t [Dk] (already L2-normalised; q is multiplied by `scale` here) and v_t [Dv]:

    S  <- diag(exp(g_t)) S
    u_t = beta_t * (v_t - Sᵀ k_t)
    S  <- S + k_t u_tᵀ
    o_t = Sᵀ (scale * q_t)

Gated DeltaNet's rule (worker_proc.kernels.gated_delta) is the case of g_t equal on every channel.
Chunked form (chunks of C tokens, G_t the cumulative g inside the chunk, per channel; S0 the state
entering it; D[t, s, c] = exp(G_t[c] - G_s[c]) for s <= t, else 0):
    (I + A) U = beta V - (beta exp(G) ⊙ K) S0,   A[t, s] = beta_t Σ_c k_t[c] k_s[c] D[t, s, c], s < t
    O = (exp(G) ⊙ Q) S0 + P U,                   P[t, s] = Σ_c q_t[c] k_s[c] D[t, s, c]
    S_C = diag(exp(G_C)) S0 + (K ⊙ exp(G_C - G))ᵀ U
Every exponent is <= 0, so no chunk-relative rescaling can overflow. The per-channel decay makes D a
[C, C, Dk] tensor per head, built one chunk at a time to bound memory. The last chunk is zero-padded
(g = 0, beta = 0, k = 0: padded tokens leave the state alone).

Shape letters: L tokens of one request, Bt requests of a decode group, H heads, Dk key dim, Dv value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_SIZE = 32
"""The chunk of the prefill form: its [H, C, C, Dk] decay tensor grows with C²."""


def _chunk_rows(t: Tensor, length: int, pad: int, c: int) -> Tensor:
    """[L, H, ...] -> [n, H, C, ...] float32, zero-padded to whole chunks."""
    t = t.float()
    t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) if t.dim() > 1 else F.pad(t, (0, pad))
    return t.view((length + pad) // c, c, *t.shape[1:]).transpose(1, 2)


def kda_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Tensor,
                chunk_size: int = CHUNK_SIZE) -> tuple[Tensor, Tensor]:  # fmt: skip
    """q, k: [L, H, Dk]; v: [L, H, Dv]; g: [L, H, Dk]; beta: [L, H]; initial_state: [H, Dk, Dv].
    Returns (o [L, H, Dv] float32, final state [H, Dk, Dv] float32)."""
    length, heads, dk = k.shape
    c = max(1, chunk_size)
    pad = (-length) % c
    qc, kc, vc = (_chunk_rows(t, length, pad, c) for t in (q, k, v))
    qc = qc * scale
    gc, bc = _chunk_rows(g, length, pad, c), _chunk_rows(beta, length, pad, c)  # [n, H, C, Dk], [n, H, C]
    cum = gc.cumsum(-2)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    strict = lower & ~torch.eye(c, dtype=torch.bool, device=q.device)
    eye = torch.eye(c, dtype=torch.float32, device=q.device)
    state = initial_state.float()
    out = []
    for i in range(cum.shape[0]):
        gi, ki, qi, vi, bi = cum[i], kc[i], qc[i], vc[i], bc[i]
        diff = (gi[:, :, None, :] - gi[:, None, :, :]).masked_fill(~lower[None, :, :, None], float("-inf"))
        decay = diff.exp()  # [H, C, C, Dk]
        a = torch.einsum("htc,hsc,htsc->hts", ki, ki, decay) * bi[..., None]
        a = a.masked_fill(~strict, 0.0)
        rhs = torch.cat([vi * bi[..., None], ki * gi.exp() * bi[..., None]], dim=-1)
        solved = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
        u0, w = solved.split([vi.shape[-1], dk], dim=-1)
        u = u0 - w @ state  # [H, C, Dv]
        p = torch.einsum("htc,hsc,htsc->hts", qi, ki, decay)
        out.append((qi * gi.exp()) @ state + p @ u)
        last = gi[:, -1:, :]  # [H, 1, Dk]
        state = state * last.transpose(1, 2).exp() + (ki * (last - gi).exp()).transpose(-1, -2) @ u
    o = torch.stack(out).transpose(1, 2).reshape(-1, heads, vc.shape[-1])[:length]
    return o, state


def kda_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
             scale: float) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One token per request, batched. state: [Bt, H, Dk, Dv]; q, k, g: [Bt, H, Dk]; v: [Bt, H, Dv];
    beta: [Bt, H]. Returns (o [Bt, H, Dv] float32, new state [Bt, H, Dk, Dv] float32)."""
    # the decay in float64, rounded: float32 exp's SIMD and scalar tails differ in the last bit, which
    # would make a request's state depend on how many share the decode call
    s = state.float() * g.double().exp().float()[..., None]
    kf = k.float()
    pred = (s * kf[..., None]).sum(-2)  # Sᵀ k: [Bt, H, Dv]
    u = (v.float() - pred) * beta.float()[..., None]
    s = s + kf[..., None] * u[..., None, :]
    o = (s * (q.float() * scale)[..., None]).sum(-2)
    return o, s


def kda_naive(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
              initial_state: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The definition, token by token (tests only): same arguments and results as `kda_chunked`."""
    state = initial_state.float()[None]
    out = []
    for t in range(q.shape[0]):
        o, state = kda_step(state, q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], scale)
        out.append(o[0])
    return torch.stack(out) if out else v.new_zeros(0, *v.shape[1:]).float(), state[0]
