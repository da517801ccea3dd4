// Fused CPU kernels of the decode step (worker_proc.kernels.native loads and describes them).
//
// Each op does in one pass over its data what the pure-torch FastOps does in tens of dispatched ops,
// with the same arithmetic: every recurrent quantity in float32, values the pure-torch path rounds to
// the model dtype (the conv outputs, a norm's result) rounded to it here too. Rules that hold:
// - the pools are read and written only at the slots given, which are distinct;
// - the recurrent-state pool is float32 and contiguous [S, H, P, N]; the conv pool [S, Cd, K-1] is
//   contiguous in the model dtype;
// - row inputs (xBC, dt, z) may be views with any row stride; their last dimension is unit-stride.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_f(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline float round_to(float v) {
  return to_f(static_cast<T>(v));
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width] with unit-stride rows");
}

// The conv step and the SSD state step of one token per slot (see mamba_decode below).
template <typename T>
at::Tensor mamba_decode_impl(const at::Tensor& xbc, const at::Tensor& dt, at::Tensor& conv_pool,
                             at::Tensor& ssm_pool, const at::Tensor& slots, const at::Tensor& conv_w,
                             const c10::optional<at::Tensor>& conv_b, const at::Tensor& a, const at::Tensor& d,
                             const at::Tensor& dt_bias, const c10::optional<at::Tensor>& head_group,
                             double dt_min, double dt_max, int64_t groups) {
  const int64_t rows = xbc.size(0), cd = xbc.size(1), k = conv_w.size(1), heads = dt.size(1);
  const int64_t p = ssm_pool.size(2), n = ssm_pool.size(3), inner = heads * p, per_group = heads / groups;
  TORCH_CHECK(cd == inner + 2 * groups * n, "xBC width ", cd, " is not heads * head_dim + 2 * groups * d_state");
  TORCH_CHECK(heads % groups == 0 || head_group.has_value(), "heads must spread evenly over the groups");
  TORCH_CHECK(conv_pool.size(1) == cd && conv_pool.size(2) == k - 1, "conv pool does not match the conv weight");
  TORCH_CHECK(ssm_pool.size(1) == heads && ssm_pool.size(2) == p && ssm_pool.size(3) == n,
              "state pool is not [S, heads, head_dim, d_state]");
  const T* xbc_p = xbc.data_ptr<T>();
  const T* dt_p = dt.data_ptr<T>();
  const int64_t xbc_rs = xbc.stride(0), dt_rs = dt.stride(0);
  T* conv_p = conv_pool.data_ptr<T>();
  float* state_p = ssm_pool.data_ptr<float>();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const T* w_p = conv_w.data_ptr<T>();
  const T* b_p = conv_b.has_value() ? conv_b->data_ptr<T>() : nullptr;
  at::Tensor a32 = a.to(at::kFloat).contiguous(), d32 = d.to(at::kFloat).contiguous();
  at::Tensor bias32 = dt_bias.to(at::kFloat).contiguous();
  const float *a_p = a32.data_ptr<float>(), *d_p = d32.data_ptr<float>(), *bias_p = bias32.data_ptr<float>();
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  std::vector<int64_t> group_of(heads);
  for (int64_t h = 0; h < heads; ++h) group_of[h] = h / std::max<int64_t>(per_group, 1);
  if (head_group.has_value()) {
    at::Tensor hg = head_group->to(at::kLong).contiguous();
    TORCH_CHECK(hg.numel() == heads, "head_group must name one group per head");
    for (int64_t h = 0; h < heads; ++h) group_of[h] = hg.data_ptr<int64_t>()[h];
  }

  // 1. conv: out = silu(sum(window * w) + b) rounded to T; the window shifts in the new input
  at::Tensor conv_out = at::empty({rows, cd}, xbc.options().dtype(at::kFloat));
  float* co_p = conv_out.data_ptr<float>();
  at::parallel_for(0, rows * cd, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / cd, c = i % cd;
      T* win = conv_p + (slot_p[r] * cd + c) * (k - 1);
      const T* w = w_p + c * k;
      const T x = xbc_p[r * xbc_rs + c];
      float acc = 0.0f;
      for (int64_t j = 0; j < k - 1; ++j) acc += to_f(win[j]) * to_f(w[j]);
      acc += to_f(x) * to_f(w[k - 1]);
      if (b_p != nullptr) acc += to_f(b_p[c]);
      for (int64_t j = 0; j + 1 < k - 1; ++j) win[j] = win[j + 1];
      if (k > 1) win[k - 2] = x;
      co_p[i] = round_to<T>(silu(acc));
    }
  });

  // 2. scan: state = state * exp(dt a) + (dt x) B; y = state . C + D x, one pass over each state row
  at::Tensor y = at::empty({rows, heads, p}, xbc.options().dtype(at::kFloat));
  float* y_p = y.data_ptr<float>();
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / heads, h = i % heads, g = group_of[h];
      float step = softplus(to_f(dt_p[r * dt_rs + h]) + bias_p[h]);
      step = std::min(std::max(step, lo), hi);
      const float decay = std::exp(step * a_p[h]);
      const float* row_in = co_p + r * cd;
      const float* x = row_in + h * p;
      const float* bv = row_in + inner + g * n;
      const float* cv = row_in + inner + groups * n + g * n;
      float* st = state_p + ((slot_p[r] * heads + h) * p) * n;
      float* out = y_p + (r * heads + h) * p;
      for (int64_t q = 0; q < p; ++q) {
        const float dtx = step * x[q];
        float* srow = st + q * n;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < n; ++j) {
          const float s = srow[j] * decay + dtx * bv[j];
          srow[j] = s;
          acc += s * cv[j];
        }
        out[q] = acc + x[q] * d_p[h];
      }
    }
  });
  return y;
}

at::Tensor mamba_decode(const at::Tensor& xbc, const at::Tensor& dt, at::Tensor conv_pool, at::Tensor ssm_pool,
                        const at::Tensor& slots, const at::Tensor& conv_w, const c10::optional<at::Tensor>& conv_b,
                        const at::Tensor& a, const at::Tensor& d, const at::Tensor& dt_bias,
                        const c10::optional<at::Tensor>& head_group, double dt_min, double dt_max, int64_t groups) {
  check_rows(xbc, "xBC");
  check_rows(dt, "dt");
  TORCH_CHECK(conv_pool.is_contiguous() && conv_w.is_contiguous(), "conv pool and weight must be contiguous");
  TORCH_CHECK(ssm_pool.scalar_type() == at::kFloat && ssm_pool.is_contiguous(), "state pool must be float32");
  TORCH_CHECK(xbc.scalar_type() == conv_pool.scalar_type() && xbc.scalar_type() == conv_w.scalar_type() &&
                  xbc.scalar_type() == dt.scalar_type(),
              "xBC, dt, conv pool and conv weight must share one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be int64");
  at::Tensor w = conv_w.contiguous();
  c10::optional<at::Tensor> b;
  if (conv_b.has_value()) b = conv_b->contiguous();
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xbc.scalar_type(), "mamba_decode", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      out = mamba_decode_impl<scalar_t>(xbc, dt, conv_pool, ssm_pool, slots, w, b, a, d, dt_bias, head_group,
                                        dt_min, dt_max, groups);
    } else {
      TORCH_CHECK(false, "float64 is not a model dtype");
    }
  });
  return out;
}

// Mamba2's gated RMSNorm per group of channels: norm(y * silu(z)) * w, or with `before_gate`
// norm(y) * w * silu(z); without a weight only y * silu(z). y [rows, I] float32; z [rows, I] in the
// model dtype. Returns float32 [rows, I] (the mixer rounds it to its dtype before out_proj).
template <typename T>
at::Tensor gated_rms_norm_impl(const at::Tensor& y, const at::Tensor& z, const c10::optional<at::Tensor>& weight,
                               int64_t groups, double eps, bool before_gate) {
  const int64_t rows = y.size(0), width = y.size(1), size = width / groups;
  at::Tensor out = at::empty({rows, width}, y.options().dtype(at::kFloat));
  at::Tensor w32;
  if (weight.has_value()) w32 = weight->to(at::kFloat).contiguous();
  const float* w_p = weight.has_value() ? w32.data_ptr<float>() : nullptr;
  const float* y_p = y.data_ptr<float>();
  const T* z_p = z.data_ptr<T>();
  const int64_t y_rs = y.stride(0), z_rs = z.stride(0);
  float* o_p = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(size);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / groups, off = (i % groups) * size;
      const float* yr = y_p + r * y_rs + off;
      const T* zr = z_p + r * z_rs + off;
      float* orow = o_p + r * width + off;
      for (int64_t j = 0; j < size; ++j) gate[j] = silu(to_f(zr[j]));
      if (w_p == nullptr) {
        for (int64_t j = 0; j < size; ++j) orow[j] = yr[j] * gate[j];
        continue;
      }
      float ss = 0.0f;
      for (int64_t j = 0; j < size; ++j) {
        const float h = before_gate ? yr[j] : yr[j] * gate[j];
        orow[j] = h;
        ss += h * h;
      }
      const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(size) + e);
      const float* w = w_p + off;
      for (int64_t j = 0; j < size; ++j) {
        const float v = orow[j] * rstd * w[j];
        orow[j] = before_gate ? v * gate[j] : v;
      }
    }
  });
  return out;
}

at::Tensor gated_rms_norm(const at::Tensor& y, const at::Tensor& z, const c10::optional<at::Tensor>& weight,
                          int64_t groups, double eps, bool before_gate) {
  check_rows(y, "y");
  check_rows(z, "z");
  TORCH_CHECK(y.scalar_type() == at::kFloat, "y must be float32");
  TORCH_CHECK(y.sizes() == z.sizes() && y.size(1) % groups == 0, "y and z must be [rows, groups * size]");
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "gated_rms_norm", [&] {
    out = gated_rms_norm_impl<scalar_t>(y, z, weight, groups, eps, before_gate);
  });
  return out;
}

// The residual-stream RMSNorm with transformers' rounding for each weighting (`RmsWeighting`): x / rms(x)
// rounded to the model dtype, then times the weight and rounded again (kModelDtype); times the weight
// in float32 and rounded once (kFloat32); times (1 + weight) in float32 and rounded once (kUnitOffset).
// x [rows, width] (any row stride); the statistics are float32.
enum RmsWeighting : int64_t { kModelDtype = 0, kFloat32 = 1, kUnitOffset = 2 };

template <typename T>
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t weighting) {
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor out = at::empty({rows, width}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const T* x_p = x.data_ptr<T>();
  const T* w_p = weight.data_ptr<T>();
  T* o_p = out.data_ptr<T>();
  const int64_t rs = x.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x_p + r * rs;
      float ss = 0.0f;
      for (int64_t j = 0; j < width; ++j) ss += to_f(xr[j]) * to_f(xr[j]);
      const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(width) + e);
      T* orow = o_p + r * width;
      for (int64_t j = 0; j < width; ++j) {
        const float v = to_f(xr[j]) * rstd;
        const float w = to_f(w_p[j]);
        if (weighting == kModelDtype) {
          orow[j] = static_cast<T>(w * round_to<T>(v));
        } else if (weighting == kFloat32) {
          orow[j] = static_cast<T>(w * v);
        } else {
          orow[j] = static_cast<T>(v * (1.0f + w));
        }
      }
    }
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t weighting) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1),
              "the norm weight must be [width] in x's dtype");
  TORCH_CHECK(weighting >= kModelDtype && weighting <= kUnitOffset, "unknown weighting ", weighting);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    out = rms_norm_impl<scalar_t>(x, weight, eps, weighting);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(hyssm_cpu, m) {
  m.def(
      "mamba_decode(Tensor xbc, Tensor dt, Tensor(a!) conv_pool, Tensor(b!) ssm_pool, Tensor slots, "
      "Tensor conv_w, Tensor? conv_b, Tensor a, Tensor d, Tensor dt_bias, Tensor? head_group, float dt_min, "
      "float dt_max, int groups) -> Tensor");
  m.def("gated_rms_norm(Tensor y, Tensor z, Tensor? weight, int groups, float eps, bool before_gate) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int weighting) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) {
  m.impl("mamba_decode", mamba_decode);
  m.impl("gated_rms_norm", gated_rms_norm);
  m.impl("rms_norm", rms_norm);
}
