// What the fused CPU kernels share (worker_proc.kernels.native loads and describes them).
//
// Each op does in one pass over its data what the pure-torch FastOps does in tens of dispatched ops,
// with the same arithmetic: every recurrent quantity in float32, values the pure-torch path rounds to
// the model dtype (the conv outputs, a norm's result) rounded to it here too. Rules that hold:
// - the pools are read and written only at the slots given, which are distinct;
// - the recurrent-state pool is contiguous [S, H, P, N] in its storage (`StatePool`), read into
//   float32 once per call and head and written back once; the conv pool [S, Cd, K-1] is contiguous in
//   the model dtype;
// - row inputs (xBC, dt, z) may be views with any row stride; their last dimension is unit-stride.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace hyssm_cpu {

// Conversions between float and the model dtypes; bfloat16's as branch-free bit arithmetic (round to
// nearest even, NaN kept a NaN) so that loops over them vectorize.
inline float to_f(float v) { return v; }
inline float to_f(c10::Half v) { return static_cast<float>(v); }
inline float to_f(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T from_f(float v) {
  return static_cast<T>(v);
}

template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return c10::BFloat16(v != v ? static_cast<uint16_t>(0x7FC0) : rounded, c10::BFloat16::from_bits());
}

template <typename T>
inline float round_to(float v) {
  return to_f(from_f<T>(v));
}

// exp without a libm call, so that loops over it vectorize: 2^k * e^r with |r| <= ln2 / 2 and a degree-6
// polynomial for e^r (relative error about 2e-7, as a float's own rounding); arguments clamped to
// [-87, 88], where the result stays a normal float.
inline float exp_approx(float v) {
  v = std::min(std::max(v, -87.0f), 88.0f);
  const float k = std::nearbyint(v * 1.44269504088896341f);
  const float r = (v - k * 0.693145751953125f) - k * 1.428606765330187045e-06f;
  float poly = 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return poly * scale;
}

inline float silu(float v) { return v / (1.0f + exp_approx(-v)); }

inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

// What both attention kernels require of their query rows q [N, H, d] and KV pools [S, kvh, d].
inline void check_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "q [N, H, d], pools [S, kvh, d]");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && k_pool.strides() == v_pool.strides(),
              "the K and V pools must be laid out alike");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(),
              "q and the pools must share one dtype");
  TORCH_CHECK(k_pool.stride(2) == 1, "pool rows must be unit-stride");
  TORCH_CHECK(k_pool.size(2) == q.size(2) && q.size(1) % k_pool.size(1) == 0,
              "q and the pools disagree on heads or width");
}

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width] with unit-stride rows");
}

// Sixteen float32 lanes as a GCC/Clang vector type: one AVX-512 register, two AVX2 ones, four SSE or NEON
// ones. The kernels are written once over it; the compiler lowers each operation to the widest vectors the
// target has (`a * b + c` contracts to a fused multiply-add under -ffp-contract=fast), so no kernel needs
// an ISA extension to build, and the AVX-512 intrinsics below are only faster forms of the same loads.
typedef float vf16 __attribute__((vector_size(64)));
typedef uint16_t vu16x16 __attribute__((vector_size(32)));
typedef uint32_t vu32x16 __attribute__((vector_size(64)));

// Independent chains of multiply-adds a fused product keeps per sum when it multiplies R rows at once (the
// tiled kernels): enough to keep the multipliers busy while each chain waits on its last add.
template <int R>
constexpr int unroll() {
  return R == 1 ? 4 : (R == 2 ? 2 : 1);
}

// v in every lane (a broadcast; `vf16{} + v` would also add 0.0 to v first, which the compiler may not
// drop: -0.0 + 0.0 is +0.0)
inline vf16 splat(float v) { return vf16{v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }
inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, vf16 v) { std::memcpy(p, &v, sizeof(v)); }

// 16 consecutive values of a model dtype widened to float32 lanes
inline vf16 load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vf16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
#else
  vu16x16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const vu32x16 wide = __builtin_convertvector(raw, vu32x16) << 16;
  vf16 v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
#endif
}
inline vf16 load16(const c10::Half* p) {
#if defined(__AVX512F__)
  return (vf16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  float wide[16];
  for (int l = 0; l < 16; ++l) wide[l] = to_f(p[l]);
  return load16(wide);
#endif
}

// 16 consecutive int8 values (a quantized weight's) as float32 lanes, exactly.
typedef int8_t vi8x16 __attribute__((vector_size(16)));
inline vf16 load16(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vi8x16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  return __builtin_convertvector(raw, vf16);
#endif
}
template <typename T, std::enable_if_t<std::is_same_v<T, int8_t>, int> = 0>  // not a candidate for other types
inline float to_f(T v) {
  return static_cast<float>(v);
}

// The sum of the 16 lanes (AVX-512: the compiler's reduction; elsewhere halving, in one fixed order).
inline float sum16(vf16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float lanes[16];
  std::memcpy(lanes, &v, sizeof(lanes));
  for (int w = 8; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
#endif
}

typedef int32_t vi16 __attribute__((vector_size(64)));

inline vf16 max16(vf16 a, vf16 b) { return a > b ? a : b; }

// The largest of the 16 lanes.
inline float max_lanes(vf16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  float lanes[16];
  std::memcpy(lanes, &v, sizeof(lanes));
  return *std::max_element(lanes, lanes + 16);
#endif
}

// `exp_approx` of 16 lanes, except that an argument below -87 (-inf included) gives exactly 0: a masked
// score weighs nothing.
inline vf16 exp16(vf16 v) {
  const vf16 lo = splat(-87.0f), hi = splat(88.0f), magic = splat(12582912.0f);  // 1.5 * 2^23 rounds to integers
  const vf16 x = v < lo ? lo : (v > hi ? hi : v);
  const vf16 k = (x * splat(1.44269504088896341f) + magic) - magic;
  const vf16 r = (x - k * splat(0.693145751953125f)) - k * splat(1.428606765330187045e-06f);
  vf16 poly = splat(1.0f / 720.0f);
  poly = poly * r + splat(1.0f / 120.0f);
  poly = poly * r + splat(1.0f / 24.0f);
  poly = poly * r + splat(1.0f / 6.0f);
  poly = poly * r + splat(0.5f);
  poly = poly * r + splat(1.0f);
  poly = poly * r + splat(1.0f);
  const vi16 bits = (__builtin_convertvector(k, vi16) + 127) << 23;
  const vf16 out = poly * (vf16)bits;
  return v < lo ? vf16{} : out;
}

constexpr int64_t kLanes = 16;  // the width of the dot products' partial sums (one AVX-512 vector of floats)

// The sum of `kLanes` partial sums, halving: the same order in every call (the decode and prefill scans
// advance every state row through `advance_row`'s arithmetic, so they sum a state row in one order).
inline float lane_sum(float* acc) {
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
#pragma omp simd
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// One state row through one token: row = row * decay + u B, returning row . C, summed as `advance_head`
// sums each of its rows (kLanes partial sums, then `lane_sum`).
inline float advance_row(float* srow, int64_t n, float decay, float u, const float* bt, const float* ct) {
  const int64_t body = n - n % kLanes;
  float acc[kLanes] = {};
  for (int64_t j0 = 0; j0 < body; j0 += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = srow[j0 + l] * decay + u * bt[j0 + l];
      srow[j0 + l] = v;
      acc[l] += v * ct[j0 + l];
    }
  }
  for (int64_t j = body; j < n; ++j) {
    srow[j] = srow[j] * decay + u * bt[j];
    acc[j - body] += srow[j] * ct[j];
  }
  return lane_sum(acc);
}

// One token through one head's state rows: for each of the head's `p` rows q, state[q] = state[q] * decay +
// (step x[q]) B and out[q] = state[q] . C + d x[q]. Rows go four at a time so that four independent
// dot products share each load of B and C and hide each other's latency; each dot product keeps
// `kLanes` partial sums (lane l adds the elements j = l mod kLanes) that `lane_sum` adds at the end (a
// reduction left to the compiler spilled them and added them one after another, the longest part of a
// token's work).
inline void advance_head(float* st, int64_t p, int64_t n, float decay, float step, const float* x, const float* bt,
                         const float* ct, float d, float* out) {
  const int64_t body = n - n % kLanes;
  int64_t q = 0;
  for (; q + 4 <= p; q += 4) {
    float* s0 = st + q * n;
    float* s1 = s0 + n;
    float* s2 = s1 + n;
    float* s3 = s2 + n;
    const float u0 = step * x[q], u1 = step * x[q + 1], u2 = step * x[q + 2], u3 = step * x[q + 3];
    float a0[kLanes] = {}, a1[kLanes] = {}, a2[kLanes] = {}, a3[kLanes] = {};
    for (int64_t j0 = 0; j0 < body; j0 += kLanes) {
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t j = j0 + l;
        const float bj = bt[j], cj = ct[j];
        const float v0 = s0[j] * decay + u0 * bj, v1 = s1[j] * decay + u1 * bj;
        const float v2 = s2[j] * decay + u2 * bj, v3 = s3[j] * decay + u3 * bj;
        s0[j] = v0;
        s1[j] = v1;
        s2[j] = v2;
        s3[j] = v3;
        a0[l] += v0 * cj;
        a1[l] += v1 * cj;
        a2[l] += v2 * cj;
        a3[l] += v3 * cj;
      }
    }
    for (int64_t j = body; j < n; ++j) {
      const float bj = bt[j], cj = ct[j];
      s0[j] = s0[j] * decay + u0 * bj;
      s1[j] = s1[j] * decay + u1 * bj;
      s2[j] = s2[j] * decay + u2 * bj;
      s3[j] = s3[j] * decay + u3 * bj;
      a0[j - body] += s0[j] * cj;
      a1[j - body] += s1[j] * cj;
      a2[j - body] += s2[j] * cj;
      a3[j - body] += s3[j] * cj;
    }
    out[q] = lane_sum(a0) + x[q] * d;
    out[q + 1] = lane_sum(a1) + x[q + 1] * d;
    out[q + 2] = lane_sum(a2) + x[q + 2] * d;
    out[q + 3] = lane_sum(a3) + x[q + 3] * d;
  }
  for (; q < p; ++q) out[q] = advance_row(st + q * n, n, decay, step * x[q], bt, ct) + x[q] * d;
}

// `advance_head` with the head's rows read one after another, front to back: the same arithmetic in the
// same order, so the same bits. For a state read from memory once per call (a decode step): one
// sequential stream per thread is what the hardware prefetchers follow, where four rows side by side
// are four interleaved streams. `advance_head` suits a state that stays in cache over a segment's tokens.
inline void advance_head_streaming(float* st, int64_t p, int64_t n, float decay, float step, const float* x,
                                   const float* bt, const float* ct, float d, float* out) {
  for (int64_t q = 0; q < p; ++q) out[q] = advance_row(st + q * n, n, decay, step * x[q], bt, ct) + x[q] * d;
}

// A layer's recurrent-state pool [S, H, P, N] in its storage (worker_proc.kernels.state_codec): float32,
// bfloat16, or int8 values with one float32 scale per (slot, head, row) [S, H, P]. A head's rows are
// read into float32 (`load`) and written back encoded (`store`): bfloat16 rounded to nearest even; int8
// symmetric per row, scale = amax / 127 and values round(x * (127 / amax)) (an all-zero row: scale 0).
// A float32 pool is updated in place (`direct`). Stores to padding slot 0 are dropped.
struct StatePool {
  at::ScalarType kind;
  float* f32 = nullptr;
  c10::BFloat16* bf16 = nullptr;
  int8_t* q8 = nullptr;
  float* scale = nullptr;
  int64_t heads, p, n;

  StatePool(at::Tensor& pool, const c10::optional<at::Tensor>& scales)
      : kind(pool.scalar_type()), heads(pool.size(1)), p(pool.size(2)), n(pool.size(3)) {
    TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous(), "state pool must be contiguous [S, H, P, N]");
    if (kind == at::kFloat) {
      f32 = pool.data_ptr<float>();
    } else if (kind == at::kBFloat16) {
      bf16 = pool.data_ptr<c10::BFloat16>();
    } else {
      TORCH_CHECK(kind == at::kChar && scales.has_value() && scales->scalar_type() == at::kFloat &&
                      scales->is_contiguous() && scales->numel() * n == pool.numel(),
                  "state pool must be float32, bfloat16, or int8 with float32 scales [S, H, P]");
      q8 = pool.data_ptr<int8_t>();
      scale = scales->data_ptr<float>();
    }
  }

  bool direct() const { return f32 != nullptr; }

  // the head's rows: in place for float32, else `buf` [P * N] filled from the pool
  float* load(int64_t slot, int64_t h, float* buf) const {
    const int64_t base = (slot * heads + h) * p * n;
    if (f32 != nullptr) return f32 + base;
    if (bf16 != nullptr) {
      for (int64_t i = 0; i < p * n; ++i) buf[i] = to_f(bf16[base + i]);
      return buf;
    }
    for (int64_t q = 0; q < p; ++q) {
      const float sc = scale[(slot * heads + h) * p + q];
      const int8_t* v = q8 + base + q * n;
      float* dst = buf + q * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(v[j]) * sc;
    }
    return buf;
  }

  void store(int64_t slot, int64_t h, const float* rows) const {
    if (f32 != nullptr || slot == 0) return;
    const int64_t base = (slot * heads + h) * p * n;
    if (bf16 != nullptr) {
      for (int64_t i = 0; i < p * n; ++i) bf16[base + i] = from_f<c10::BFloat16>(rows[i]);
      return;
    }
    for (int64_t q = 0; q < p; ++q) {
      const float* src = rows + q * n;
      float amax = 0.0f;
#pragma omp simd reduction(max : amax)
      for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::abs(src[j]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* v = q8 + base + q * n;
      for (int64_t j = 0; j < n; ++j) v[j] = static_cast<int8_t>(std::nearbyint(src[j] * inv));
      scale[(slot * heads + h) * p + q] = amax / 127.0f;
    }
  }
};

}  // namespace hyssm_cpu
