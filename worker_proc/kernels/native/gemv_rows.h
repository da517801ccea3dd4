// The row kernels of the few-row products (gemv_ops.cpp): dot products of up to kPassRows input rows with a
// range of weight rows, read in one of two orders (see gemv_ops.cpp's rules), the weight float32,
// bfloat16 or int8 (a quantized weight, whose per-row scale multiplies each finished dot product).
// Included by gemv_ops.cpp only (its anonymous namespace holds these).
#pragma once

#include "cpu_common.h"
#include "layout.h"

namespace hyssm_cpu {
namespace {

constexpr int64_t WEIGHT_ROWS = 4;  // weight rows read side by side
constexpr int64_t PREFETCH_ROWS = 8;  // how far ahead (in weight rows) the loop asks for the weight
constexpr int SEQ_VECTORS = 2;  // vectors of one weight row per step of `gemv_seq` (accumulation chains per input row)

// acc[r][i] = sum_k x[r][k] * w_i[k] for R input rows (float32, row stride k) and WR weight rows.
template <typename W, int R, int WR>
inline void dot_block(const float* x, int64_t k, const W* const* w, float (*acc)[WEIGHT_ROWS]) {
  int64_t j = 0;
  vf16 sums[R][WR];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < WR; ++i) sums[r][i] = vf16{};
  for (; j + kLanes <= k; j += kLanes) {
    vf16 wv[WR];
    for (int i = 0; i < WR; ++i) {
      __builtin_prefetch(w[i] + j + PREFETCH_ROWS * k, 0, 3);
      wv[i] = load16(w[i] + j);
    }
    for (int r = 0; r < R; ++r) {
      const vf16 xv = load16(x + r * k + j);
      for (int i = 0; i < WR; ++i) sums[r][i] = xv * wv[i] + sums[r][i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < WR; ++i) acc[r][i] = sum16(sums[r][i]);
  for (; j < k; ++j) {
    for (int i = 0; i < WR; ++i) {
      const float wj = to_f(w[i][j]);
      for (int r = 0; r < R; ++r) acc[r][i] += x[r * k + j] * wj;
    }
  }
}

#if defined(__AVX512BF16__)
// dot_block for bfloat16 weights and bfloat16 input rows (row stride k): each instruction multiplies 32
// pairs and adds each pair's two products to a float32 lane, so a weight vector is read without widening.
template <int R, int WR>
inline void dot_block_bf16(const c10::BFloat16* x, int64_t k, const c10::BFloat16* const* w,
                           float (*acc)[WEIGHT_ROWS]) {
  __m512 sums[R][WR];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < WR; ++i) sums[r][i] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= k; j += 32) {
    __m512bh wv[WR];
    for (int i = 0; i < WR; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(w[i] + j + PREFETCH_ROWS * k), _MM_HINT_T0);
      wv[i] = (__m512bh)_mm512_loadu_si512(w[i] + j);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + j);
      for (int i = 0; i < WR; ++i) sums[r][i] = _mm512_dpbf16_ps(sums[r][i], xv, wv[i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < WR; ++i) acc[r][i] = _mm512_reduce_add_ps(sums[r][i]);
  for (; j < k; ++j)
    for (int i = 0; i < WR; ++i)
      for (int r = 0; r < R; ++r) acc[r][i] += to_f(x[r * k + j]) * to_f(w[i][j]);
}

#endif

// The dot products of R input rows x (float32, or bfloat16 where the weight is too and the CPU multiplies
// bfloat16 pairs) with WR weight rows.
template <int R, int WR, typename W>
inline void dot_rows(const float* x, int64_t k, const W* const* w, float (*acc)[WEIGHT_ROWS]) {
  dot_block<W, R, WR>(x, k, w, acc);
}
#if defined(__AVX512BF16__)
template <int R, int WR>
inline void dot_rows(const c10::BFloat16* x, int64_t k, const c10::BFloat16* const* w, float (*acc)[WEIGHT_ROWS]) {
  dot_block_bf16<R, WR>(x, k, w, acc);
}
#endif

// acc[r] = x[r] . w for R input rows (float32, row stride k) and one weight row read front to back.
template <int R, typename W>
inline void row_dot(const float* x, int64_t k, const W* w, float* acc) {
  vf16 sums[R][SEQ_VECTORS];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < SEQ_VECTORS; ++u) sums[r][u] = vf16{};
  int64_t j = 0;
  for (; j + SEQ_VECTORS * kLanes <= k; j += SEQ_VECTORS * kLanes) {
    vf16 wv[SEQ_VECTORS];
    for (int u = 0; u < SEQ_VECTORS; ++u) wv[u] = load16(w + j + u * kLanes);
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < SEQ_VECTORS; ++u) sums[r][u] = load16(x + r * k + j + u * kLanes) * wv[u] + sums[r][u];
  }
  for (; j + kLanes <= k; j += kLanes) {
    const vf16 wv = load16(w + j);
    for (int r = 0; r < R; ++r) sums[r][0] = load16(x + r * k + j) * wv + sums[r][0];
  }
  for (int r = 0; r < R; ++r) {
    vf16 total = sums[r][0];
    for (int u = 1; u < SEQ_VECTORS; ++u) total += sums[r][u];
    acc[r] = sum16(total);
  }
  for (; j < k; ++j) {
    const float wj = to_f(w[j]);
    for (int r = 0; r < R; ++r) acc[r] += x[r * k + j] * wj;
  }
}

#if defined(__AVX512BF16__)
// row_dot for a bfloat16 weight row and bfloat16 input rows (row stride k), multiplied in pairs.
template <int R>
inline void row_dot(const c10::BFloat16* x, int64_t k, const c10::BFloat16* w, float* acc) {
  __m512 sums[R][SEQ_VECTORS];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < SEQ_VECTORS; ++u) sums[r][u] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + SEQ_VECTORS * 32 <= k; j += SEQ_VECTORS * 32) {
    __m512bh wv[SEQ_VECTORS];
    for (int u = 0; u < SEQ_VECTORS; ++u) wv[u] = (__m512bh)_mm512_loadu_si512(w + j + u * 32);
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < SEQ_VECTORS; ++u)
        sums[r][u] = _mm512_dpbf16_ps(sums[r][u], (__m512bh)_mm512_loadu_si512(x + r * k + j + u * 32), wv[u]);
  }
  for (; j + 32 <= k; j += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j);
    for (int r = 0; r < R; ++r) sums[r][0] = _mm512_dpbf16_ps(sums[r][0], (__m512bh)_mm512_loadu_si512(x + r * k + j), wv);
  }
  for (int r = 0; r < R; ++r) {
    __m512 total = sums[r][0];
    for (int u = 1; u < SEQ_VECTORS; ++u) total = _mm512_add_ps(total, sums[r][u]);
    acc[r] = _mm512_reduce_add_ps(total);
  }
  for (; j < k; ++j)
    for (int r = 0; r < R; ++r) acc[r] += to_f(x[r * k + j]) * to_f(w[j]);
}
#endif

// One output: the dot product times the row's scale (a quantized weight's; none: 1), plus the bias.
inline float finish(float acc, const float* scale, const float* bias, int64_t row) {
  return (scale ? acc * scale[row] : acc) + (bias ? bias[row] : 0.0f);
}

template <typename W, typename O, int R, typename X>
void seq_range(const X* x, int64_t k, const W* w, const float* scale, const float* bias, O* out, int64_t n,
               int64_t begin, int64_t end) {
  float acc[R];
  for (int64_t row = begin; row < end; ++row) {
    row_dot<R>(x, k, w + row * k, acc);
    for (int r = 0; r < R; ++r) out[r * n + row] = from_f<O>(finish(acc[r], scale, bias, row));
  }
}

template <typename W, typename O, int R, typename X>
void rows_range(const X* x, int64_t k, const W* w, const float* scale, const float* bias, O* out, int64_t n,
                int64_t begin, int64_t end) {
  constexpr int WR = R <= 4 ? WEIGHT_ROWS : WEIGHT_ROWS / 2;  // R * WR accumulators stay in registers
  float acc[kPassRows][WEIGHT_ROWS];
  for (int64_t row = begin; row < end;) {
    const int64_t take = std::min<int64_t>(WR, end - row);
    const W* ws[WEIGHT_ROWS];
    for (int64_t i = 0; i < take; ++i) ws[i] = w + (row + i) * k;
    if (take == WR) {
      dot_rows<R, WR>(x, k, ws, acc);
    } else {
      for (int64_t i = 0; i < take; ++i) {
        float one[kPassRows][WEIGHT_ROWS];
        dot_rows<R, 1>(x, k, ws + i, one);
        for (int r = 0; r < R; ++r) acc[r][i] = one[r][0];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < take; ++i)
        out[r * n + row + i] = from_f<O>(finish(acc[r][i], scale, bias, row + i));
    row += take;
  }
}

template <typename W, typename O, int R, typename X>
void range_in_order(bool sequential, const X* x, int64_t k, const W* w, const float* scale, const float* bias, O* out,
                    int64_t n, int64_t begin, int64_t end) {
  if (sequential) return seq_range<W, O, R>(x, k, w, scale, bias, out, n, begin, end);
  rows_range<W, O, R>(x, k, w, scale, bias, out, n, begin, end);
}

template <typename W, typename O, typename X>
void gemv_group(bool sequential, const X* x, int64_t rows, int64_t k, const W* w, const float* scale,
                const float* bias, O* out, int64_t n, int64_t begin, int64_t end) {
  with_rows<kPassRows>(rows, [&](auto r) { range_in_order<W, O, decltype(r)::value>(sequential, x, k, w, scale, bias, out, n, begin, end); });
}

}  // namespace
}  // namespace hyssm_cpu
