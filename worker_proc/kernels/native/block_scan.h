// The prefill SSD scan over blocks of BLOCK tokens (scan_ops.cpp `ssd_prefill` runs it on each segment's
// whole blocks where `block_scan_fits`; the tokens after the last whole block, and every segment shorter
// than BLOCK_MIN_TOKENS, go token by token through `advance_head`, which decode shares).
//
// Within a block starting at state s, with cumulative log-decays c[t] = sum_{i<=t} step_i a (float32):
//   y_t = exp(c[t]) (s . C_t) + sum_{tau<=t} exp(c[t] - c[tau]) step_tau (C_t . B_tau) x_tau + D x_t
//   s'  = exp(c[last]) s + sum_tau exp(c[last] - c[tau]) step_tau x_tau (x) B_tau
// (the same sums as token by token, in another order). A head's state is held transposed, [N][P], for the
// segment, so that both sums over the state run along P in vector registers with no horizontal sums;
// every state element is read and written once per block instead of once per token. C_t . B_tau is the
// same for every head of a group and is computed once per block and group (`block_gram`).
#pragma once

#include "cpu_common.h"

namespace hyssm_cpu {

constexpr int64_t BLOCK = 8;               // tokens per block: BLOCK accumulators + BLOCK inputs stay in registers
constexpr int64_t BLOCK_MIN_TOKENS = 32;   // shorter segments (draft verification among them) go token by token
constexpr int64_t BLOCK_LANES = 16;        // floats per vector register: P and N must be multiples

inline bool block_scan_fits(int64_t p, int64_t n) { return p % BLOCK_LANES == 0 && n % BLOCK_LANES == 0; }

// For block blk (starting at row block_rows[blk]) and group g, u = blk * groups + g:
// gram[u * BLOCK * BLOCK + t * BLOCK + tau] = C_{t0+t} . B_{t0+tau} for tau <= t (0 above), and
// packed[(u * n + j) * 2 * BLOCK + t] = C_{t0+t}[j], [... + BLOCK + t] = B_{t0+t}[j] (a block's C and B
// values of one state column in one cache line); b, c are [T, G, N] in the model dtype (row stride `rs`,
// group stride `gs`, unit-stride N), read as float32.
template <typename T>
inline void block_gram(const T* b, const T* c, int64_t rs, int64_t gs, int64_t groups, int64_t n,
                       const std::vector<int64_t>& block_rows, float* gram, float* packed) {
  const int64_t blocks = static_cast<int64_t>(block_rows.size());
  at::parallel_for(0, blocks * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cs(BLOCK * n), bs(BLOCK * n);  // the block's C and B rows, widened
    for (int64_t u = begin; u < end; ++u) {
      const int64_t blk = u / groups, g = u % groups, t0 = block_rows[blk];
      float* out = gram + u * BLOCK * BLOCK;
      float* pk = packed + u * n * 2 * BLOCK;
      for (int64_t t = 0; t < BLOCK; ++t) {
        const T* ct = c + (t0 + t) * rs + g * gs;
        const T* bt = b + (t0 + t) * rs + g * gs;
        for (int64_t j = 0; j < n; ++j) {
          cs[t * n + j] = to_f(ct[j]);
          bs[t * n + j] = to_f(bt[j]);
          pk[j * 2 * BLOCK + t] = cs[t * n + j];
          pk[j * 2 * BLOCK + BLOCK + t] = bs[t * n + j];
        }
      }
      for (int64_t t = 0; t < BLOCK; ++t) {
        const float* ct = cs.data() + t * n;
        for (int64_t tau = 0; tau < BLOCK; ++tau) {
          float acc = 0.0f;
          if (tau <= t) {
            const float* bt = bs.data() + tau * n;
#pragma omp simd reduction(+ : acc)
            for (int64_t j = 0; j < n; ++j) acc += ct[j] * bt[j];
          }
          out[t * BLOCK + tau] = acc;
        }
      }
    }
  });
}

// What one head's block reads: rows t0..t0+BLOCK-1 of x in the model dtype (row stride xs, head offset applied), the
// head's step per row (stride ss), and its group's packed C and B values and gram (`block_gram`).
template <typename T>
struct BlockInput {
  const T* x;
  int64_t xs;
  const float* step;
  int64_t ss;
  const float* packed;
  const float* gram;
};

// 16 x 16 floats: out row c = in column c (rows of in and out `in_stride` / `out_stride` floats apart).
inline void transpose16(const float* in, int64_t in_stride, float* out, int64_t out_stride) {
#if defined(__AVX512F__)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * in_stride);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // lane k of r[4i + j]: column 4k + j of rows 4i..4i+3
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 even_lo = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), even_hi = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    const __m512 odd_lo = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD), odd_hi = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
    _mm512_storeu_ps(out + j * out_stride, _mm512_shuffle_f32x4(even_lo, even_hi, 0x88));
    _mm512_storeu_ps(out + (8 + j) * out_stride, _mm512_shuffle_f32x4(even_lo, even_hi, 0xDD));
    _mm512_storeu_ps(out + (4 + j) * out_stride, _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88));
    _mm512_storeu_ps(out + (12 + j) * out_stride, _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xDD));
  }
#else
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) out[j * out_stride + i] = in[i * in_stride + j];
#endif
}

// dst [cols][rows] = src [rows][cols]^T; both multiples of 16
inline void transpose_state(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; r += 16)
    for (int64_t c = 0; c < cols; c += 16) transpose16(src + r * cols + c, cols, dst + c * rows + r, rows);
}

// One block of one head: st_t [N][P] advances BLOCK tokens; y rows (row stride ys) get the outputs.
template <typename T>
inline void scan_block(float* st_t, int64_t p, int64_t n, float a, float d, const BlockInput<T>& in, float* y,
                       int64_t ys) {
  static_assert(BLOCK == 8, "the register loop below names eight tokens");
  float cs[BLOCK], e[BLOCK], v[BLOCK], w[BLOCK][BLOCK];
  float run = 0.0f;
  for (int64_t t = 0; t < BLOCK; ++t) {
    run += in.step[t * in.ss] * a;
    cs[t] = run;
  }
  for (int64_t t = 0; t < BLOCK; ++t) {
    e[t] = exp_approx(cs[t]);
    v[t] = exp_approx(cs[BLOCK - 1] - cs[t]) * in.step[t * in.ss];
    for (int64_t tau = 0; tau < BLOCK; ++tau)
      w[t][tau] = tau <= t ? exp_approx(cs[t] - cs[tau]) * in.gram[t * BLOCK + tau] * in.step[tau * in.ss] : 0.0f;
  }
  const vf16 end_decay = splat(exp_approx(cs[BLOCK - 1]));
  for (int64_t q = 0; q < p; q += BLOCK_LANES) {
    vf16 xin[BLOCK];
    for (int64_t t = 0; t < BLOCK; ++t) xin[t] = load16(in.x + t * in.xs + q);
    const vf16 u0 = splat(v[0]) * xin[0], u1 = splat(v[1]) * xin[1];
    const vf16 u2 = splat(v[2]) * xin[2], u3 = splat(v[3]) * xin[3];
    const vf16 u4 = splat(v[4]) * xin[4], u5 = splat(v[5]) * xin[5];
    const vf16 u6 = splat(v[6]) * xin[6], u7 = splat(v[7]) * xin[7];
    vf16 a0 = vf16{}, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    float* col = st_t + q;
    const float* cb = in.packed;
    for (int64_t j = 0; j < n; ++j, col += p, cb += 2 * BLOCK) {
      const vf16 s = load16(col);
      a0 = splat(cb[0]) * s + a0;
      a1 = splat(cb[1]) * s + a1;
      a2 = splat(cb[2]) * s + a2;
      a3 = splat(cb[3]) * s + a3;
      a4 = splat(cb[4]) * s + a4;
      a5 = splat(cb[5]) * s + a5;
      a6 = splat(cb[6]) * s + a6;
      a7 = splat(cb[7]) * s + a7;
      vf16 lo = s * end_decay;
      vf16 hi = splat(cb[8]) * u0;
      lo = splat(cb[9]) * u1 + lo;
      hi = splat(cb[10]) * u2 + hi;
      lo = splat(cb[11]) * u3 + lo;
      hi = splat(cb[12]) * u4 + hi;
      lo = splat(cb[13]) * u5 + lo;
      hi = splat(cb[14]) * u6 + hi;
      lo = splat(cb[15]) * u7 + lo;
      store16(col, lo + hi);
    }
    const vf16 acc[BLOCK] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int64_t t = 0; t < BLOCK; ++t) {
      vf16 out = splat(e[t]) * acc[t];
      for (int64_t tau = 0; tau <= t; ++tau) out = splat(w[t][tau]) * xin[tau] + out;
      store16(y + t * ys + q, splat(d) * xin[t] + out);
    }
  }
}

}  // namespace hyssm_cpu
