// Rows of x quantized to int8 for the int8-activation products (w8a8_ops.cpp, w4a8_ops.cpp), as
// worker_proc.quant.weight `quantize_rows` makes them, to the bit: a float32 scale per row, max |row| / 127
// (1 for a zero row), each value divided by it and rounded half to even.
#pragma once

#include "cpu_common.h"

namespace hyssm_cpu {

// x's rows as int8 with a float32 scale each, as `quantize_rows` makes them (to the bit: max |row| / 127, 1 for a
// zero row; each value divided by it and rounded half to even).
template <typename T>
inline void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t stride, int8_t* xq, float* xs) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * stride;
    int8_t* q = xq + r * k;
    float amax = 0.0f;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 most = _mm512_setzero_ps();
    for (; j + 16 <= k; j += 16) most = _mm512_max_ps(most, _mm512_abs_ps((__m512)load16(row + j)));
    amax = _mm512_reduce_max_ps(most);
#endif
    for (; j < k; ++j) amax = std::max(amax, std::abs(to_f(row[j])));
    float s = amax / 127.0f;
    s = s > 0.0f ? s : 1.0f;
    xs[r] = s;
    j = 0;
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(s);
    for (; j + 16 <= k; j += 16) {  // an exact division, rounded half to even: nearbyint's value
      const __m512 v = _mm512_roundscale_ps(_mm512_div_ps((__m512)load16(row + j), sv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
#endif
    for (; j < k; ++j) q[j] = static_cast<int8_t>(std::nearbyint(to_f(row[j]) / s));
  }
}

// x's rows quantized (`quantize_rows`) into xq [M * K] and xs [M].
inline void quantized_rows(const at::Tensor& x, const char* op, std::vector<int8_t>& xq, std::vector<float>& xs) {
  const int64_t m = x.size(0), k = x.size(1);
  xq.resize(m * k);
  xs.resize(m);
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), m, k, x.stride(0), xq.data(), xs.data());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": x must be float32 or bfloat16");
    quantize_rows(x.data_ptr<c10::BFloat16>(), m, k, x.stride(0), xq.data(), xs.data());
  }
}

}  // namespace hyssm_cpu
