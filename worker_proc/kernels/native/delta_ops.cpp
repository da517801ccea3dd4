// The gated delta rule token by token, for Gated DeltaNet (a decay per head; worker_proc.kernels.gated_delta) and
// Kimi Delta Attention (a decay per key channel; worker_proc.kernels.kimi_delta). Per request r and head h, with
// the state S [Dk, Dv] in float32 and d = exp(g) (g [1] or [Dk], broadcast over Dk):
//     S <- diag(d) S;  u = beta (v - Sᵀk);  S <- S + k uᵀ;  o = Sᵀ(scale q).
// Rules that hold:
// - the slots are read from their tensor here (no slot list in Python), and each slot's head is read from the
//   pool in its storage (StatePool: float32 in place, bfloat16 or int8 through a float32 buffer) once per call
//   and written back once, after the last token of its segment;
// - every quantity is float32 (v converted from the model dtype); the threads split the (segment, head) pairs,
//   each of which owns its state rows, so the result does not depend on the thread count;
// - a decode step (one token per slot) takes the decay as the torch step does, exp in float64 rounded to float32,
//   so its decay is the reference's bit for bit; the tokens of a prefill segment take `exp_approx` (the torch
//   prefill is chunked and agrees with the recurrence only to rounding);
// - `lengths` empty: one token per slot (row r advances slots[r]); else segment i is the next lengths[i] rows and
//   advances slots[i].
#include <torch/library.h>

#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

// State values times tokens below which a share of the (segment, head) tasks is not worth waking a thread for
// (a small model's decode step runs on the calling thread).
constexpr int64_t kThreadWork = 1 << 14;

// The rows one call advances: segment i is rows [start[i], start[i] + len[i]) of slot[i].
struct Segments {
  std::vector<int64_t> start, len, slot;
  bool decode = false;  // one token per slot (`lengths` empty)
};

Segments segments_of(const at::Tensor& slots, at::IntArrayRef lengths, int64_t rows) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "slots must be int64");
  const at::Tensor sc = slots.contiguous();
  const int64_t* slot_p = sc.data_ptr<int64_t>();
  Segments out;
  out.decode = lengths.empty();
  if (out.decode) {
    TORCH_CHECK(slots.size(0) == rows, "slots must be int64, one per row");
    for (int64_t r = 0; r < rows; ++r) out.start.push_back(r), out.len.push_back(1), out.slot.push_back(slot_p[r]);
    return out;
  }
  TORCH_CHECK(slots.size(0) == static_cast<int64_t>(lengths.size()), "one slot per segment");
  int64_t start = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    TORCH_CHECK(lengths[i] >= 0, "a segment's length is negative");
    out.start.push_back(start), out.len.push_back(lengths[i]), out.slot.push_back(slot_p[i]);
    start += lengths[i];
  }
  TORCH_CHECK(start == rows, "the segments' lengths do not add up to the rows");
  return out;
}

// d = exp(g) for the Dk key channels of one token and head: g holds `width` values (1: one decay for every
// channel; dk: one per channel).
inline void fill_decay(const float* g, int64_t width, int64_t dk, bool exact, float* d) {
  if (width == 1) {
    std::fill(d, d + dk, exact ? static_cast<float>(std::exp(static_cast<double>(g[0]))) : exp_approx(g[0]));
  } else if (exact) {
    for (int64_t i = 0; i < dk; ++i) d[i] = static_cast<float>(std::exp(static_cast<double>(g[i])));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < dk; ++i) d[i] = exp_approx(g[i]);
  }
}

// The two passes of one token over `w` columns of a head's state s (row stride dv), in vectors of 16 columns
// (N of them, held in registers over the dk rows) or, for a last w < 16, one column at a time. Each column's
// sum runs over the rows in order, so a column gives the same numbers whichever way it is taken.
//   decay pass:  s[i, :] *= d[i];  o = Sᵀk
//   update pass: s[i, :] += k[i] u;  o = Sᵀ(scale q)
template <int N>
inline void decay_columns(float* s, int64_t dv, int64_t dk, const float* d, const float* k, float* o) {
  vf16 acc[N] = {};
  for (int64_t i = 0; i < dk; ++i) {
    float* si = s + i * dv;
    const vf16 di = splat(d[i]), ki = splat(k[i]);
    for (int n = 0; n < N; ++n) {
      const vf16 x = load16(si + 16 * n) * di;
      store16(si + 16 * n, x);
      acc[n] += ki * x;
    }
  }
  for (int n = 0; n < N; ++n) store16(o + 16 * n, acc[n]);
}

template <int N>
inline void update_columns(float* s, int64_t dv, int64_t dk, const float* k, const float* q, float qscale,
                           const float* u, float* o) {
  vf16 uv[N], acc[N] = {};
  for (int n = 0; n < N; ++n) uv[n] = load16(u + 16 * n);
  for (int64_t i = 0; i < dk; ++i) {
    float* si = s + i * dv;
    const vf16 ki = splat(k[i]), qi = splat(q[i] * qscale);
    for (int n = 0; n < N; ++n) {
      const vf16 x = load16(si + 16 * n) + ki * uv[n];
      store16(si + 16 * n, x);
      acc[n] += qi * x;
    }
  }
  for (int n = 0; n < N; ++n) store16(o + 16 * n, acc[n]);
}

inline void decay_tail(float* s, int64_t dv, int64_t dk, int64_t w, const float* d, const float* k, float* o) {
  std::fill(o, o + w, 0.0f);
  for (int64_t i = 0; i < dk; ++i) {
    float* si = s + i * dv;
    for (int64_t j = 0; j < w; ++j) {
      si[j] *= d[i];
      o[j] += k[i] * si[j];
    }
  }
}

inline void update_tail(float* s, int64_t dv, int64_t dk, int64_t w, const float* k, const float* q, float qscale,
                        const float* u, float* o) {
  std::fill(o, o + w, 0.0f);
  for (int64_t i = 0; i < dk; ++i) {
    float* si = s + i * dv;
    const float qi = q[i] * qscale;
    for (int64_t j = 0; j < w; ++j) {
      si[j] += k[i] * u[j];
      o[j] += qi * si[j];
    }
  }
}

// One pass over every column of s: blocks of 64, then of 16, then the rest (`pass(N, j0, w)`, N = 0: a tail
// of w < 16 columns).
template <typename Pass>
inline void over_columns(int64_t dv, Pass&& pass) {
  int64_t j0 = 0;
  for (; j0 + 64 <= dv; j0 += 64) pass(std::integral_constant<int, 4>{}, j0);
  for (; j0 + 16 <= dv; j0 += 16) pass(std::integral_constant<int, 1>{}, j0);
  if (j0 < dv) pass(std::integral_constant<int, 0>{}, j0);
}

// One token on one head's state s [dk, dv] in place: d [dk] the decay, k and q [dk], v [dv]; o [dv] receives
// Sᵀ(scale q); u [dv] is scratch.
template <typename T>
inline void delta_token(float* s, const float* d, const float* k, const float* q, const T* v, float beta,
                        float qscale, int64_t dk, int64_t dv, float* u, float* o) {
  over_columns(dv, [&](auto n, int64_t j0) {
    if constexpr (n.value == 0) {
      decay_tail(s + j0, dv, dk, dv - j0, d, k, o + j0);
    } else {
      decay_columns<n.value>(s + j0, dv, dk, d, k, o + j0);
    }
  });
  for (int64_t j = 0; j < dv; ++j) u[j] = (to_f(v[j]) - o[j]) * beta;
  over_columns(dv, [&](auto n, int64_t j0) {
    if constexpr (n.value == 0) {
      update_tail(s + j0, dv, dk, dv - j0, k, q, qscale, u + j0, o + j0);
    } else {
      update_columns<n.value>(s + j0, dv, dk, k, q, qscale, u + j0, o + j0);
    }
  });
}

// q, k [T, H, Dk], g [T, H, width] and beta [T, H] float32, v [T, H, Dv] in a model dtype, all contiguous.
template <typename T>
at::Tensor delta_rule_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, double scale, const StatePool& states, const Segments& segs) {
  const int64_t rows = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2), width = g.size(2);
  TORCH_CHECK(states.heads == heads && states.p == dk && states.n == dv,
              "state pool is not [S, heads, key dim, value dim] of q and v");
  at::Tensor out = at::empty({rows, heads, dv}, q.options().dtype(at::kFloat));
  const float *q_p = q.data_ptr<float>(), *k_p = k.data_ptr<float>();
  const float *g_p = g.data_ptr<float>(), *beta_p = beta.data_ptr<float>();
  const T* v_p = v.data_ptr<T>();
  float* o_p = out.data_ptr<float>();
  const float qscale = static_cast<float>(scale);
  const int64_t count = static_cast<int64_t>(segs.slot.size());
  const int64_t task_work = std::max<int64_t>(1, rows / std::max<int64_t>(1, count)) * dk * dv;
  const int64_t grain = std::max<int64_t>(1, kThreadWork / task_work);
  at::parallel_for(0, count * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(states.direct() ? 0 : dk * dv), u(dv), d(dk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seg = task / heads, h = task % heads, slot = segs.slot[seg];
      if (segs.len[seg] == 0) continue;
      float* s = states.load(slot, h, buf.data());
      for (int64_t t = segs.start[seg]; t < segs.start[seg] + segs.len[seg]; ++t) {
        const int64_t row = t * heads + h;
        fill_decay(g_p + row * width, width, dk, segs.decode, d.data());
        delta_token(s, d.data(), k_p + row * dk, q_p + row * dk, v_p + row * dv, beta_p[row], qscale, dk, dv,
                    u.data(), o_p + row * dv);
      }
      states.store(slot, h, s);
    }
  });
  return out;
}

// q, k [T, H, Dk] float32; v [T, H, Dv] in a model dtype; g [T, H] or [T, H, Dk] and beta [T, H] float32;
// pool [S, H, Dk, Dv] (and its scales when int8); slots int64, distinct. Returns o [T, H, Dv] float32.
at::Tensor delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, double scale, at::Tensor& pool,
                      const c10::optional<at::Tensor>& pool_scale, const at::Tensor& slots, at::IntArrayRef lengths) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1) && beta.dim() == 2 && beta.size(0) == q.size(0) && beta.size(1) == q.size(1),
              "the delta rule takes q, k [T, H, Dk], v [T, H, Dv], beta [T, H]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat &&
                  beta.scalar_type() == at::kFloat,
              "q, k, g and beta must be float32");
  const Segments segs = segments_of(slots, lengths, q.size(0));
  const StatePool states(pool, pool_scale);
  const at::Tensor g3 = (g.dim() == 2 ? g.unsqueeze(2) : g).contiguous();
  at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), bc = beta.contiguous();
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "delta_rule", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      out = delta_rule_impl<scalar_t>(qc, kc, vc, g3, bc, scale, states, segs);
    } else {
      TORCH_CHECK(false, "float64 is not a model dtype");
    }
  });
  return out;
}

// Gated DeltaNet's decode step: g and beta [B, H], one token per slot.
at::Tensor gdn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, double scale, at::Tensor pool, const c10::optional<at::Tensor>& pool_scale,
                      const at::Tensor& slots) {
  TORCH_CHECK(g.dim() == 2 && g.sizes() == beta.sizes(), "gdn_decode takes g and beta [B, H]");
  return delta_rule(q, k, v, g, beta, scale, pool, pool_scale, slots, {});
}

// Kimi Delta Attention: g [T, H, Dk]; `lengths` as the file's rules say (empty: the decode step).
at::Tensor kda_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                    const at::Tensor& beta, double scale, at::Tensor pool, const c10::optional<at::Tensor>& pool_scale,
                    const at::Tensor& slots, at::IntArrayRef lengths) {
  TORCH_CHECK(g.sizes() == k.sizes(), "kda_rule takes g [T, H, Dk], as k");
  return delta_rule(q, k, v, g, beta, scale, pool, pool_scale, slots, lengths);
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) {
  m.impl("gdn_decode", hyssm_cpu::gdn_decode);
  m.impl("kda_rule", hyssm_cpu::kda_rule);
}
