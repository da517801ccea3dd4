// Prefill attention: the queries of one request's chunk (context positions start..start+L-1) over its
// context, read from the KV pools at its slots. Rules that hold:
// - query i attends to context positions 0..start+i (causal, aligned to the end of the context);
// - the context's keys and values are packed once per call into the caller's workspace, each KV head's
//   keys as groups of kLanes keys interleaved so that kLanes scores of one query are one vector of
//   products: widened to float32 (`WideContext`), or, for bfloat16 on a CPU with AVX512-BF16, kept in
//   bfloat16 pairs for its pair dot product (`PairContext`);
// - scores are exact products of the model dtype's values summed in float32, and the softmax is float32
//   and online over blocks of kKeyBlock keys, as flash attention's: a row's partial output is rescaled
//   when its running maximum grows; the weighted sum of values is float32 (the weights rounded to
//   bfloat16 first in `PairContext`); the output is rounded once to the model dtype;
// - a work item is a block of kQueryBlock query positions of one KV head, its rows every query head that
//   shares that KV head; the threads take the items round-robin, so that the causal triangle's uneven
//   items spread evenly over them, and KV head by KV head, so that they read one head's context at a
//   time (the whole packed context of a long one does not stay in cache).
#include <torch/library.h>

#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

constexpr int64_t kQueryBlock = 16;  // query positions of one work item
constexpr int64_t kKeyBlock = 64;    // keys of one online-softmax step: kKeyVectors vectors of scores
constexpr int64_t kKeyVectors = kKeyBlock / kLanes;
constexpr int64_t kTileRows = 4;   // rows of one register tile
constexpr int64_t kTileWidth = 4;  // vectors of d one register tile of the output holds

struct Layout {
  int64_t heads, kv_heads, group;  // query heads, KV heads, query heads per KV head
  int64_t q_stride[2];             // q / out rows: position, head (out is contiguous like q)
  int64_t kv_stride[2];            // pools: slot, head
  int64_t start;                   // the context position of query 0
};

// The context widened to float32 (in the caller's workspace): the products are float32 fused
// multiply-adds of the model dtype's values.
struct WideContext {
  int64_t d, padded;  // padded: the context length rounded up to kKeyBlock (the padding is masked)
  float* k;           // [kv_heads][padded / kLanes][d][kLanes]
  float* v;           // [kv_heads][padded][d]

  WideContext(int64_t d_, int64_t padded_, int64_t kv_heads, float* workspace)
      : d(d_), padded(padded_), k(workspace), v(workspace + kv_heads * padded_ * d_) {}
  float* key_group(int64_t g, int64_t t) const { return k + (g * (padded / kLanes) + t / kLanes) * d * kLanes; }
  float* value_row(int64_t g, int64_t t) const { return v + (g * padded + t) * d; }

  // Keys [t0, t0 + kLanes) of KV head g (zeros past `keys`).
  template <typename T>
  void pack(const T* k_pool, const T* v_pool, const int64_t* idx, int64_t keys, int64_t g, int64_t t0,
            const Layout& l) const {
    float* kd = key_group(g, t0);
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t t = t0 + lane;
      float* vd = value_row(g, t);
      if (t >= keys) {
        for (int64_t j = 0; j < d; ++j) kd[j * kLanes + lane] = 0.0f;
        std::fill(vd, vd + d, 0.0f);
        continue;
      }
      const T* kr = k_pool + idx[t] * l.kv_stride[0] + g * l.kv_stride[1];
      const T* vr = v_pool + idx[t] * l.kv_stride[0] + g * l.kv_stride[1];
      for (int64_t j = 0; j < d; ++j) kd[j * kLanes + lane] = to_f(kr[j]);
      for (int64_t j = 0; j < d; j += kLanes) store16(vd + j, load16(vr + j));
    }
  }

  // A query row as the score tiles read it: float32, the scale applied.
  template <typename T>
  void load_query(const T* qr, float scale, float* dst) const {
    for (int64_t j = 0; j < d; j += kLanes) store16(dst + j, load16(qr + j) * splat(scale));
  }

  // sc[r][0..kKeyBlock) = qf[r] . K[kb + t] for R rows: R x kKeyVectors accumulators, each key vector
  // loaded once per element of d and each query element broadcast once.
  template <int R>
  void scores(const float* qf, int64_t g, int64_t kb, float* sc, float) const {
    vf16 acc[R][kKeyVectors] = {};
    const float* kg[kKeyVectors];
    for (int64_t u = 0; u < kKeyVectors; ++u) kg[u] = key_group(g, kb + u * kLanes);
    for (int64_t j = 0; j < d; ++j) {
      vf16 kv[kKeyVectors];
      for (int64_t u = 0; u < kKeyVectors; ++u) kv[u] = load16(kg[u] + j * kLanes);
      for (int r = 0; r < R; ++r) {
        const vf16 qv = splat(qf[r * d + j]);
        for (int64_t u = 0; u < kKeyVectors; ++u) acc[r][u] = qv * kv[u] + acc[r][u];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t u = 0; u < kKeyVectors; ++u) store16(sc + r * kKeyBlock + u * kLanes, acc[r][u]);
  }

  void weights(const float*, int64_t, void*) const {}  // the value tiles read the float32 weights

  // o[r][j0..j0 + kTileWidth * kLanes) += sum over the block's keys t of p[r][t] * V[kb + t][...], R rows.
  template <int R>
  void values(const float* p, const void*, int64_t g, int64_t kb, int64_t j0, float* o) const {
    vf16 acc[R][kTileWidth];
    for (int r = 0; r < R; ++r)
      for (int64_t u = 0; u < kTileWidth; ++u) acc[r][u] = load16(o + r * d + j0 + u * kLanes);
    for (int64_t t = 0; t < kKeyBlock; ++t) {
      const float* vr = value_row(g, kb + t) + j0;
      vf16 vv[kTileWidth];
      for (int64_t u = 0; u < kTileWidth; ++u) vv[u] = load16(vr + u * kLanes);
      for (int r = 0; r < R; ++r) {
        const vf16 pv = splat(p[r * kKeyBlock + t]);
        for (int64_t u = 0; u < kTileWidth; ++u) acc[r][u] = pv * vv[u] + acc[r][u];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t u = 0; u < kTileWidth; ++u) store16(o + r * d + j0 + u * kLanes, acc[r][u]);
  }
};

#if defined(__AVX512BF16__)
// A bfloat16 context kept in bfloat16, interleaved in pairs for AVX512-BF16's dot product of pairs
// (`vdpbf16ps`: two exact products added into a float32 lane): the keys as [group of kLanes keys][d / 2]
// [kLanes][2], the values as [pair of keys][d][2]. Scores are exact products of the model's values, as
// in `WideContext`; the softmax weights are rounded to bfloat16 for the weighted sum (as the GEMMs of
// torch's flash attention round them).
struct PairContext {
  int64_t d, padded;
  uint16_t* k;
  uint16_t* v;

  PairContext(int64_t d_, int64_t padded_, int64_t kv_heads, float* workspace)
      : d(d_), padded(padded_), k(reinterpret_cast<uint16_t*>(workspace)), v(k + kv_heads * padded_ * d_) {}
  uint16_t* key_group(int64_t g, int64_t t) const { return k + (g * (padded / kLanes) + t / kLanes) * d * kLanes; }
  uint16_t* value_pair(int64_t g, int64_t t) const { return v + (g * padded + t) * d; }  // t even

  void pack(const c10::BFloat16* k_pool, const c10::BFloat16* v_pool, const int64_t* idx, int64_t keys, int64_t g,
            int64_t t0, const Layout& l) const {
    uint16_t* kd = key_group(g, t0);
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t t = t0 + lane;
      uint16_t* vd = value_pair(g, t & ~int64_t{1}) + (t & 1);
      if (t >= keys) {
        for (int64_t j = 0; j < d; ++j) kd[(j / 2) * 2 * kLanes + lane * 2 + (j & 1)] = vd[2 * j] = 0;
        continue;
      }
      const c10::BFloat16* kr = k_pool + idx[t] * l.kv_stride[0] + g * l.kv_stride[1];
      const c10::BFloat16* vr = v_pool + idx[t] * l.kv_stride[0] + g * l.kv_stride[1];
      for (int64_t j = 0; j < d; ++j) {
        kd[(j / 2) * 2 * kLanes + lane * 2 + (j & 1)] = kr[j].x;
        vd[2 * j] = vr[j].x;
      }
    }
  }

  // A query row as it is (bfloat16 pairs, one 32-bit word each); the scale goes on the scores.
  void load_query(const c10::BFloat16* qr, float, float* dst) const { std::memcpy(dst, qr, d * sizeof(uint16_t)); }

  template <int R>
  void scores(const float* qw, int64_t g, int64_t kb, float* sc, float scale) const {
    __m512 acc[R][kKeyVectors];
    for (int r = 0; r < R; ++r)
      for (int64_t u = 0; u < kKeyVectors; ++u) acc[r][u] = _mm512_setzero_ps();
    const uint16_t* kg[kKeyVectors];
    for (int64_t u = 0; u < kKeyVectors; ++u) kg[u] = key_group(g, kb + u * kLanes);
    const int64_t words = d / 2;  // a query row's pairs, as 32-bit words (its stride in qw: d floats)
    for (int64_t j = 0; j < words; ++j) {
      __m512bh kv[kKeyVectors];
      for (int64_t u = 0; u < kKeyVectors; ++u) kv[u] = (__m512bh)_mm512_loadu_si512(kg[u] + j * 2 * kLanes);
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, qw + r * d + j, sizeof(word));
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(word);
        for (int64_t u = 0; u < kKeyVectors; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], qv, kv[u]);
      }
    }
    const __m512 sv = _mm512_set1_ps(scale);
    for (int r = 0; r < R; ++r)
      for (int64_t u = 0; u < kKeyVectors; ++u)
        _mm512_storeu_ps(sc + r * kKeyBlock + u * kLanes, _mm512_mul_ps(acc[r][u], sv));
  }

  // The block's float32 weights rounded to bfloat16 pairs, row by row into pw.
  void weights(const float* p, int64_t rows, void* pw) const {
    uint16_t* dst = static_cast<uint16_t*>(pw);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t u = 0; u < kKeyBlock; u += 2 * kLanes) {
        const __m512 lo = _mm512_loadu_ps(p + r * kKeyBlock + u), hi = _mm512_loadu_ps(p + r * kKeyBlock + u + kLanes);
        _mm512_storeu_si512(dst + r * kKeyBlock + u, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
  }

  template <int R>
  void values(const float*, const void* pw, int64_t g, int64_t kb, int64_t j0, float* o) const {
    const uint16_t* p = static_cast<const uint16_t*>(pw);
    __m512 acc[R][kTileWidth];
    for (int r = 0; r < R; ++r)
      for (int64_t u = 0; u < kTileWidth; ++u) acc[r][u] = _mm512_loadu_ps(o + r * d + j0 + u * kLanes);
    for (int64_t t = 0; t < kKeyBlock; t += 2) {
      const uint16_t* vr = value_pair(g, kb + t) + 2 * j0;
      __m512bh vv[kTileWidth];
      for (int64_t u = 0; u < kTileWidth; ++u) vv[u] = (__m512bh)_mm512_loadu_si512(vr + u * 2 * kLanes);
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, p + r * kKeyBlock + t, sizeof(word));
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(word);
        for (int64_t u = 0; u < kTileWidth; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], pv, vv[u]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t u = 0; u < kTileWidth; ++u) _mm512_storeu_ps(o + r * d + j0 + u * kLanes, acc[r][u]);
  }
};
#endif

// Row r's scores of one block become its softmax weights against its running maximum m[r], its running
// sum s[r] and output row are rescaled to that maximum; keys past row r's position weigh nothing.
void online_softmax(float* sc, int64_t rows, const int64_t* last, int64_t kb, float* m, float* s, float* o,
                    int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = sc + r * kKeyBlock;
    const int64_t visible = std::min<int64_t>(kKeyBlock, last[r] - kb + 1);
    if (visible <= 0) {
      std::fill(row, row + kKeyBlock, 0.0f);
      continue;
    }
    for (int64_t t = visible; t < kKeyBlock; ++t) row[t] = -INFINITY;
    vf16 top = load16(row);
    for (int64_t u = 1; u < kKeyVectors; ++u) top = max16(top, load16(row + u * kLanes));
    const float m_new = std::max(m[r], max_lanes(top));
    const vf16 shift = splat(m_new);
    vf16 total = {};
    for (int64_t u = 0; u < kKeyVectors; ++u) {
      const vf16 w = exp16(load16(row + u * kLanes) - shift);
      store16(row + u * kLanes, w);
      total += w;
    }
    const float alpha = m[r] == -INFINITY ? 0.0f : exp_approx(m[r] - m_new);
    s[r] = s[r] * alpha + sum16(total);
    m[r] = m_new;
    if (alpha != 1.0f) {
      float* orow = o + r * d;
      for (int64_t j = 0; j < d; j += kLanes) store16(orow + j, load16(orow + j) * splat(alpha));
    }
  }
}

struct Scratch {
  std::vector<float> q, sc, o, m, s;
  std::vector<uint16_t> pw;
  std::vector<int64_t> last;
  explicit Scratch(int64_t rows, int64_t d)
      : q(rows * d), sc(rows * kKeyBlock), o(rows * d), m(rows), s(rows), pw(rows * kKeyBlock), last(rows) {}
};

// One work item: query positions [i0, i1) of every query head of KV head g; row r is head
// g * group + r / (i1 - i0) at position i0 + r % (i1 - i0).
template <typename T, typename C>
void attend_item(const T* q, T* out, const C& c, const Layout& l, int64_t g, int64_t i0, int64_t i1, float scale,
                 Scratch& w) {
  const int64_t d = c.d, width = i1 - i0, rows = l.group * width;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = g * l.group + r / width, i = i0 + r % width;
    c.load_query(q + i * l.q_stride[0] + h * l.q_stride[1], scale, &w.q[r * d]);
    w.last[r] = l.start + i;
  }
  std::fill(w.o.begin(), w.o.begin() + rows * d, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, -INFINITY);
  std::fill(w.s.begin(), w.s.begin() + rows, 0.0f);
  const int64_t end = l.start + i1;  // keys [0, end) reach some row of the item
  for (int64_t kb = 0; kb < end; kb += kKeyBlock) {
    int64_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows)
      c.template scores<kTileRows>(&w.q[r * d], g, kb, &w.sc[r * kKeyBlock], scale);
    for (; r < rows; ++r) c.template scores<1>(&w.q[r * d], g, kb, &w.sc[r * kKeyBlock], scale);
    online_softmax(w.sc.data(), rows, w.last.data(), kb, w.m.data(), w.s.data(), w.o.data(), d);
    c.weights(w.sc.data(), rows, w.pw.data());
    for (int64_t j0 = 0; j0 < d; j0 += kTileWidth * kLanes) {
      for (r = 0; r + kTileRows <= rows; r += kTileRows)
        c.template values<kTileRows>(&w.sc[r * kKeyBlock], &w.pw[r * kKeyBlock], g, kb, j0, &w.o[r * d]);
      for (; r < rows; ++r) c.template values<1>(&w.sc[r * kKeyBlock], &w.pw[r * kKeyBlock], g, kb, j0, &w.o[r * d]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = g * l.group + r / width, i = i0 + r % width;
    T* orow = out + i * l.q_stride[0] + h * l.q_stride[1];
    const float inv = 1.0f / w.s[r];
    for (int64_t j = 0; j < d; ++j) orow[j] = from_f<T>(w.o[r * d + j] * inv);
  }
}

// Packs the context, then runs every work item.
template <typename T, typename C>
void attend_all(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const int64_t* idx,
                int64_t keys, const Layout& l, const C& c, float scale, at::Tensor& out) {
  const T *q_p = q.data_ptr<T>(), *k_p = k_pool.data_ptr<T>(), *v_p = v_pool.data_ptr<T>();
  T* o_p = out.data_ptr<T>();
  const int64_t length = q.size(0), groups = c.padded / kLanes;
  const int64_t blocks = (length + kQueryBlock - 1) / kQueryBlock, items = blocks * l.kv_heads;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, l.kv_heads * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) c.pack(k_p, v_p, idx, keys, u / groups, (u % groups) * kLanes, l);
  });
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch w(l.group * kQueryBlock, c.d);
    for (int64_t tid = begin; tid < end; ++tid)
      for (int64_t u = tid; u < items; u += threads) {
        const int64_t i0 = (u % blocks) * kQueryBlock;
        attend_item(q_p, o_p, c, l, u / blocks, i0, std::min(length, i0 + kQueryBlock), scale, w);
      }
  });
}

at::Tensor attn_prefill(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& kv_idx_in, int64_t start, double scale, at::Tensor& workspace) {
  check_attention(q_in, k_pool, v_pool);
  const at::Tensor q = q_in.contiguous();
  const at::Tensor kv_idx = kv_idx_in.to(at::kLong).contiguous();
  const int64_t length = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_pool.size(1);
  const int64_t keys = kv_idx.numel();
  TORCH_CHECK(d % (kTileWidth * kLanes) == 0, "the head width must be a multiple of ", kTileWidth * kLanes);
  TORCH_CHECK(start >= 0 && keys == start + length, "kv_idx must hold start + L slots");
  const int64_t* idx = kv_idx.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(idx, idx + keys, [&](int64_t i) { return i >= 0 && i < k_pool.size(0); }),
              "a KV slot outside the pools");
  const int64_t padded = (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous() &&
                  workspace.numel() >= 2 * kv_heads * padded * d,
              "the workspace must be float32 with 2 * kv_heads * padded keys * d elements");
  float* ws = workspace.data_ptr<float>();
  const Layout l{heads, kv_heads, heads / kv_heads, {q.stride(0), q.stride(1)},
                 {k_pool.stride(0), k_pool.stride(1)}, start};
  at::Tensor out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat:
      attend_all<float>(q, k_pool, v_pool, idx, keys, l, WideContext(d, padded, kv_heads, ws), sc, out);
      break;
    case at::kBFloat16:
#if defined(__AVX512BF16__)
      attend_all<c10::BFloat16>(q, k_pool, v_pool, idx, keys, l, PairContext(d, padded, kv_heads, ws), sc, out);
#else
      attend_all<c10::BFloat16>(q, k_pool, v_pool, idx, keys, l, WideContext(d, padded, kv_heads, ws), sc, out);
#endif
      break;
    case at::kHalf:
      attend_all<c10::Half>(q, k_pool, v_pool, idx, keys, l, WideContext(d, padded, kv_heads, ws), sc, out);
      break;
    default: TORCH_CHECK(false, "attn_prefill takes float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) { m.impl("attn_prefill", hyssm_cpu::attn_prefill); }
