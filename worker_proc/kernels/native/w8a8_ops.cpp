// The w8a8 product of few rows (worker_proc.model.quantized `w8a8`'s arithmetic, to the bit): the rows of x
// quantized to int8 with a float32 scale each (xq, xs, as `quantize_rows` does), an int8 weight [N, K] with a
// float32 scale per row; out[r, n] = float(sum_k xq[r, k] * w[n, k]) * (xs[r] * scale[n]), in float32. Rules
// that hold:
// - the sums are exact in int32 (|sum| <= K * 127 * 127), so the result does not depend on the summation
//   order, the thread count or the instructions: AVX512-VNNI multiplies 64 byte pairs per instruction
//   (xq + 128 as unsigned bytes, the weight's 128 * row sum taken off after), other CPUs run the same sums
//   in plain integer arithmetic;
// - the threads split the weight's rows into contiguous ranges, each row read once for up to ROWS rows of
//   x, front to back (one stream per thread, as `gemv_seq`).
#include <torch/library.h>

#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

constexpr int64_t ROWS = 8;  // input rows sharing one pass over the weight

// acc[r] = sum_j xq[r * k + j] * w[j] for R rows, exactly.
template <int R>
inline void int8_dots(const int8_t* xq, int64_t k, const int8_t* w, int32_t* acc) {
  int64_t j = 0;
  for (int r = 0; r < R; ++r) acc[r] = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i sums[R];
  for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
  __m512i wsum = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), ones = _mm512_set1_epi8(1);
  for (; j + 64 <= k; j += 64) {
    const __m512i wv = _mm512_loadu_si512(w + j);
    wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
    for (int r = 0; r < R; ++r) {
      const __m512i xu = _mm512_xor_si512(_mm512_loadu_si512(xq + r * k + j), flip);  // xq + 128, unsigned
      sums[r] = _mm512_dpbusd_epi32(sums[r], xu, wv);
    }
  }
  const int32_t row_sum = _mm512_reduce_add_epi32(wsum);
  for (int r = 0; r < R; ++r) acc[r] = _mm512_reduce_add_epi32(sums[r]) - 128 * row_sum;
#endif
  for (; j < k; ++j)
    for (int r = 0; r < R; ++r) acc[r] += static_cast<int32_t>(xq[r * k + j]) * static_cast<int32_t>(w[j]);
}

template <int R>
void rows_of(const int8_t* xq, const float* xs, int64_t k, const int8_t* w, const float* scale, float* out,
             int64_t n, int64_t begin, int64_t end) {
  int32_t acc[R];
  for (int64_t row = begin; row < end; ++row) {
    int8_dots<R>(xq, k, w + row * k, acc);
    for (int r = 0; r < R; ++r) out[r * n + row] = static_cast<float>(acc[r]) * (xs[r] * scale[row]);
  }
}

void group(const int8_t* xq, const float* xs, int64_t rows, int64_t k, const int8_t* w, const float* scale,
           float* out, int64_t n, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: return rows_of<1>(xq, xs, k, w, scale, out, n, begin, end);
    case 2: return rows_of<2>(xq, xs, k, w, scale, out, n, begin, end);
    case 3: return rows_of<3>(xq, xs, k, w, scale, out, n, begin, end);
    case 4: return rows_of<4>(xq, xs, k, w, scale, out, n, begin, end);
    case 5: return rows_of<5>(xq, xs, k, w, scale, out, n, begin, end);
    case 6: return rows_of<6>(xq, xs, k, w, scale, out, n, begin, end);
    case 7: return rows_of<7>(xq, xs, k, w, scale, out, n, begin, end);
    default: return rows_of<8>(xq, xs, k, w, scale, out, n, begin, end);
  }
}

// x's rows as int8 with a float32 scale each, as `quantize_rows` makes them (to the bit: max |row| / 127, 1 for a
// zero row; each value divided by it and rounded half to even).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t stride, int8_t* xq, float* xs) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * stride;
    float amax = 0.0f;
    for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::abs(to_f(row[j])));
    float s = amax / 127.0f;
    s = s > 0.0f ? s : 1.0f;
    xs[r] = s;
    for (int64_t j = 0; j < k; ++j) xq[r * k + j] = static_cast<int8_t>(std::nearbyint(to_f(row[j]) / s));
  }
}

// x [M, K] float32 or bfloat16 (unit-stride rows); data [N, K] int8, scale [N] float32. Returns [M, N] float32.
at::Tensor gemv_w8a8(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && data.dim() == 2 && x.size(1) == data.size(1) && x.stride(1) == 1 &&
                  data.scalar_type() == at::kChar && data.is_contiguous(),
              "gemv_w8a8: x [M, K] and a contiguous int8 weight [N, K] expected");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == data.size(0),
              "gemv_w8a8: one float32 scale per weight row expected");
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0);
  std::vector<int8_t> xq(m * k);
  std::vector<float> xs(m);
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), m, k, x.stride(0), xq.data(), xs.data());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gemv_w8a8: x must be float32 or bfloat16");
    quantize_rows(x.data_ptr<c10::BFloat16>(), m, k, x.stride(0), xq.data(), xs.data());
  }
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const int8_t* w = data.data_ptr<int8_t>();
  const float* s_p = scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < m; r += ROWS)
      group(xq.data() + r * k, xs.data() + r, std::min(ROWS, m - r), k, w, s_p, o + r * n, n, begin, end);
  });
  return out;
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_FRAGMENT(hyssm_cpu, m) { m.def("gemv_w8a8(Tensor x, Tensor data, Tensor scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) { m.impl("gemv_w8a8", hyssm_cpu::gemv_w8a8); }
