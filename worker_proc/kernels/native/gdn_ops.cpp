// The decode step of the gated delta rule (Gated DeltaNet layers; worker_proc.kernels.gated_delta): one
// token per state slot. Per request r and value head h, with the state S [Dk, Dv] in float32:
//     S <- exp(g) S;  u = beta (v - Sᵀk);  S <- S + k uᵀ;  o = Sᵀ(scale q).
// Rules that hold:
// - the slots are read from their tensor here (no slot list in Python), and each slot's head is read
//   from the pool in its storage (StatePool: float32 in place, bfloat16 or int8 through a float32
//   buffer) and written back once;
// - every quantity is float32 (v converted from the model dtype); the threads split the (request,
//   head) pairs, each of which owns its state rows, so the result does not depend on the thread count.
#include <torch/library.h>

#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

template <typename T>
at::Tensor gdn_decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, double scale, const StatePool& states, const at::Tensor& slots) {
  const int64_t rows = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(states.heads == heads && states.p == dk && states.n == dv,
              "state pool is not [S, heads, key dim, value dim] of q and v");
  at::Tensor out = at::empty({rows, heads, dv}, q.options().dtype(at::kFloat));
  const float *q_p = q.data_ptr<float>(), *k_p = k.data_ptr<float>();
  const float *g_p = g.data_ptr<float>(), *beta_p = beta.data_ptr<float>();
  const T* v_p = v.data_ptr<T>();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  float* o_p = out.data_ptr<float>();
  const float qscale = static_cast<float>(scale);
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(states.direct() ? 0 : dk * dv), u(dv), acc(dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / heads, h = task % heads, row = r * heads + h;
      const int64_t slot = slot_p[r];
      float* s = states.load(slot, h, buf.data());
      const float decay = std::exp(g_p[row]), b = beta_p[row];
      const float *kr = k_p + row * dk, *qr = q_p + row * dk;
      const T* vr = v_p + row * dv;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t i = 0; i < dk; ++i) {  // decay the state; acc = Sᵀk
        float* si = s + i * dv;
        const float ki = kr[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
          si[j] *= decay;
          acc[j] += ki * si[j];
        }
      }
      for (int64_t j = 0; j < dv; ++j) {
        u[j] = (to_f(vr[j]) - acc[j]) * b;
        acc[j] = 0.0f;
      }
      for (int64_t i = 0; i < dk; ++i) {  // S += k uᵀ; acc = Sᵀ(scale q)
        float* si = s + i * dv;
        const float ki = kr[i], qi = qr[i] * qscale;
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
          si[j] += ki * u[j];
          acc[j] += qi * si[j];
        }
      }
      std::copy(acc.begin(), acc.end(), o_p + row * dv);
      states.store(slot, h, s);
    }
  });
  return out;
}

// q, k [B, H, Dk] float32; v [B, H, Dv] in a model dtype; g, beta [B, H] float32; pool [S, H, Dk, Dv]
// (and its scales when int8); slots [B] int64, distinct. Returns o [B, H, Dv] float32.
at::Tensor gdn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, double scale, at::Tensor pool, const c10::optional<at::Tensor>& pool_scale,
                      const at::Tensor& slots) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1) && g.dim() == 2 && g.size(0) == q.size(0) && g.size(1) == q.size(1) &&
                  beta.sizes() == g.sizes(),
              "gdn_decode takes q, k [B, H, Dk], v [B, H, Dv], g and beta [B, H]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat &&
                  beta.scalar_type() == at::kFloat,
              "q, k, g and beta must be float32");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == q.size(0),
              "slots must be int64, one per row");
  const StatePool states(pool, pool_scale);
  at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous();
  at::Tensor bc = beta.contiguous(), sc = slots.contiguous();
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "gdn_decode", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      out = gdn_decode_impl<scalar_t>(qc, kc, vc, gc, bc, scale, states, sc);
    } else {
      TORCH_CHECK(false, "float64 is not a model dtype");
    }
  });
  return out;
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) { m.impl("gdn_decode", hyssm_cpu::gdn_decode); }
