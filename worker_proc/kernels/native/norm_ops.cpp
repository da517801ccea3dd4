// The norms: Mamba2's gated RMSNorm and the residual-stream RMSNorm (cpu_common.h states the rules).

#include <torch/library.h>

#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

// Mamba2's gated RMSNorm per group of channels: norm(y * silu(z)) * w, or with `before_gate`
// norm(y) * w * silu(z); without a weight only y * silu(z). y [rows, I] float32; z [rows, I] in the
// model dtype. Returns [rows, I] in float32, or with `round_out` in z's dtype (the float32 result
// rounded once, as the mixer rounds it before out_proj).
template <typename T, typename O>
void gated_rms_norm_rows(const at::Tensor& y, const at::Tensor& z, const float* w_p, int64_t groups, float e,
                         bool before_gate, O* o_p) {
  const int64_t rows = y.size(0), width = y.size(1), size = width / groups;
  const float* y_p = y.data_ptr<float>();
  const T* z_p = z.data_ptr<T>();
  const int64_t y_rs = y.stride(0), z_rs = z.stride(0);
  at::parallel_for(0, rows * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(size), prod(size);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / groups, off = (i % groups) * size;
      const float* yr = y_p + r * y_rs + off;
      const T* zr = z_p + r * z_rs + off;
      O* orow = o_p + r * width + off;
#pragma omp simd
      for (int64_t j = 0; j < size; ++j) gate[j] = silu(to_f(zr[j]));
      if (w_p == nullptr) {
        for (int64_t j = 0; j < size; ++j) orow[j] = from_f<O>(yr[j] * gate[j]);
        continue;
      }
      // the product first, then its sum of squares in a loop that only reads (one that also writes
      // the product compiles to a scalar chain of dependent adds)
      if (before_gate) {
        std::copy(yr, yr + size, prod.data());
      } else {
#pragma omp simd
        for (int64_t j = 0; j < size; ++j) prod[j] = yr[j] * gate[j];
      }
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < size; ++j) ss += prod[j] * prod[j];
      const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(size) + e);
      const float* w = w_p + off;
      for (int64_t j = 0; j < size; ++j) {
        const float v = prod[j] * rstd * w[j];
        orow[j] = from_f<O>(before_gate ? v * gate[j] : v);
      }
    }
  });
}

template <typename T>
at::Tensor gated_rms_norm_impl(const at::Tensor& y, const at::Tensor& z, const c10::optional<at::Tensor>& weight,
                               int64_t groups, double eps, bool before_gate, bool round_out) {
  at::Tensor out = at::empty({y.size(0), y.size(1)}, y.options().dtype(round_out ? z.scalar_type() : at::kFloat));
  at::Tensor w32;
  if (weight.has_value()) w32 = weight->to(at::kFloat).contiguous();
  const float* w_p = weight.has_value() ? w32.data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  if (round_out)
    gated_rms_norm_rows<T, T>(y, z, w_p, groups, e, before_gate, out.data_ptr<T>());
  else
    gated_rms_norm_rows<T, float>(y, z, w_p, groups, e, before_gate, out.data_ptr<float>());
  return out;
}

at::Tensor gated_rms_norm(const at::Tensor& y, const at::Tensor& z, const c10::optional<at::Tensor>& weight,
                          int64_t groups, double eps, bool before_gate, bool round_out) {
  check_rows(y, "y");
  check_rows(z, "z");
  TORCH_CHECK(y.scalar_type() == at::kFloat, "y must be float32");
  TORCH_CHECK(y.sizes() == z.sizes() && y.size(1) % groups == 0, "y and z must be [rows, groups * size]");
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "gated_rms_norm", [&] {
    out = gated_rms_norm_impl<scalar_t>(y, z, weight, groups, eps, before_gate, round_out);
  });
  return out;
}

// The residual-stream RMSNorm with transformers' rounding for each weighting (`RmsWeighting`): x / rms(x)
// rounded to the model dtype, then times the weight and rounded again (kModelDtype); times the weight
// in float32 and rounded once (kFloat32); times (1 + weight) in float32 and rounded once (kUnitOffset).
// x [rows, width] (any row stride); the statistics are float32.
enum RmsWeighting : int64_t { kModelDtype = 0, kFloat32 = 1, kUnitOffset = 2 };

// One row: orow = norm(xr) with `weighting`'s rounding (xr and orow may not overlap).
template <typename T>
inline void norm_row(const T* xr, const T* w_p, T* orow, int64_t width, float eps, int64_t weighting) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < width; ++j) ss += to_f(xr[j]) * to_f(xr[j]);
  const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(width) + eps);
  if (weighting == kModelDtype) {
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) orow[j] = from_f<T>(to_f(w_p[j]) * round_to<T>(to_f(xr[j]) * rstd));
  } else if (weighting == kFloat32) {
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) orow[j] = from_f<T>(to_f(w_p[j]) * (to_f(xr[j]) * rstd));
  } else {
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) orow[j] = from_f<T>((to_f(xr[j]) * rstd) * (1.0f + to_f(w_p[j])));
  }
}

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
    for (int64_t r = begin; r < end; ++r) norm_row(x_p + r * rs, w_p, o_p + r * width, width, e, weighting);
  });
  return out;
}

// The residual add of a sublayer's output and the next norm in one pass over the rows: h' = h + alpha y
// (alpha rounded to the model dtype first, the sum in float32 rounded once: torch.add(h, y, alpha=alpha)'s
// arithmetic), then norm(h') as `rms_norm` computes it. Returns (h', norm(h')), contiguous, in the dtype.
template <typename T>
std::tuple<at::Tensor, at::Tensor> add_rms_norm_impl(const at::Tensor& h, const at::Tensor& y, double alpha,
                                                     const at::Tensor& weight, double eps, int64_t weighting) {
  const int64_t rows = h.size(0), width = h.size(1);
  const auto options = h.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor sum = at::empty({rows, width}, options), out = at::empty({rows, width}, options);
  const T *h_p = h.data_ptr<T>(), *y_p = y.data_ptr<T>(), *w_p = weight.data_ptr<T>();
  T *s_p = sum.data_ptr<T>(), *o_p = out.data_ptr<T>();
  const int64_t hs = h.stride(0), ys = y.stride(0);
  const float a = round_to<T>(static_cast<float>(alpha)), e = static_cast<float>(eps);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *hr = h_p + r * hs, *yr = y_p + r * ys;
      T* sr = s_p + r * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) sr[j] = from_f<T>(to_f(hr[j]) + to_f(yr[j]) * a);
      norm_row(sr, w_p, o_p + r * width, width, e, weighting);
    }
  });
  return {sum, out};
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

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& y, double alpha,
                                                const at::Tensor& weight, double eps, int64_t weighting) {
  check_rows(h, "h");
  check_rows(y, "y");
  TORCH_CHECK(h.sizes() == y.sizes() && h.scalar_type() == y.scalar_type(), "h and y must share a shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == h.scalar_type() && weight.numel() == h.size(1),
              "the norm weight must be [width] in h's dtype");
  TORCH_CHECK(weighting >= kModelDtype && weighting <= kUnitOffset, "unknown weighting ", weighting);
  std::tuple<at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm", [&] {
    out = add_rms_norm_impl<scalar_t>(h, y, alpha, weight, eps, weighting);
  });
  return out;
}

// A gated MLP's activation: silu(gate) * up of gate, up [rows, I] (the model dtype, unit-stride rows of any
// stride each: the two halves of one fused product, or two products). Returns [rows, I] in the dtype: the
// SiLU rounded to it, then the product rounded (F.silu(gate) * up's roundings; the exponential is exp_approx).
template <typename T>
at::Tensor silu_mul_impl(const at::Tensor& gate, const at::Tensor& up) {
  const int64_t rows = gate.size(0), width = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  constexpr int64_t kSpan = 512;    // columns per task
  constexpr int64_t kInline = 16;   // fewer tasks than this run on the calling thread (waking the others
                                    // costs more than a decode row's few thousand elements)
  const int64_t spans = (width + kSpan - 1) / kSpan;
  at::Tensor out = at::empty({rows, width}, gate.options().memory_format(at::MemoryFormat::Contiguous));
  const T* g_p = gate.data_ptr<T>();
  const T* u_p = up.data_ptr<T>();
  T* o_p = out.data_ptr<T>();
  at::parallel_for(0, rows * spans, kInline, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / spans, lo = (t % spans) * kSpan, hi = std::min(width, lo + kSpan);
      const T* grow = g_p + r * gs;
      const T* urow = u_p + r * us;
      T* orow = o_p + r * width;
#pragma omp simd
      for (int64_t j = lo; j < hi; ++j) orow[j] = from_f<T>(round_to<T>(silu(to_f(grow[j]))) * to_f(urow[j]));
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "silu_mul: gate and up must share a shape and dtype");
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "silu_mul", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      out = silu_mul_impl<scalar_t>(gate, up);
    } else {
      TORCH_CHECK(false, "float64 is not a model dtype");
    }
  });
  return out;
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) {
  m.impl("silu_mul", hyssm_cpu::silu_mul);
  m.impl("gated_rms_norm", hyssm_cpu::gated_rms_norm);
  m.impl("rms_norm", hyssm_cpu::rms_norm);
  m.impl("add_rms_norm", hyssm_cpu::add_rms_norm);
}
