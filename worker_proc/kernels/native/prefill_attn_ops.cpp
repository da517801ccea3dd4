// Prefill attention: the queries of one request's chunk (context positions start..start+L-1) over its
// context, read from the KV pools at its slots. Rules that hold:
// - query i attends to context positions 0..start+i (causal, aligned to the end of the context);
// - the context's keys and values are widened to float32 once per call into the caller's workspace,
//   each KV head's keys as [group of kLanes keys][d][kLanes], so that kLanes scores of one query are one
//   vector of fused multiply-adds, and its values as [key][d];
// - scores, the softmax and the weighted sum of values are float32 (exact products of the model
//   dtype's values); the softmax is online over blocks of kKeyBlock keys, as flash attention's: a row's
//   partial output is rescaled when its running maximum grows; the output is rounded once to the
//   model dtype;
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

// The packed float32 context of one call (in the caller's workspace).
struct Packed {
  int64_t d, padded;  // padded: the context length rounded up to kKeyBlock (the padding is masked)
  float* k;           // [kv_heads][padded / kLanes][d][kLanes]
  float* v;           // [kv_heads][padded][d]
  float* key_group(int64_t g, int64_t t) const { return k + (g * (padded / kLanes) + t / kLanes) * d * kLanes; }
  float* value_row(int64_t g, int64_t t) const { return v + (g * padded + t) * d; }
};

struct Layout {
  int64_t heads, kv_heads, group;  // query heads, KV heads, query heads per KV head
  int64_t q_stride[2];             // q / out rows: position, head (out is contiguous like q)
  int64_t kv_stride[2];            // pools: slot, head
  int64_t start;                   // the context position of query 0
};

// Keys [t0, t0 + kLanes) of every KV head into the packed context (zeros past `keys`).
template <typename T>
void pack_group(const T* k_pool, const T* v_pool, const int64_t* idx, int64_t keys, int64_t t0, const Layout& l,
                const Packed& c) {
  const int64_t d = c.d;
  for (int64_t g = 0; g < l.kv_heads; ++g) {
    float* kd = c.key_group(g, t0);
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t t = t0 + lane;
      float* vd = c.value_row(g, t);
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
}

// sc[r][0..kKeyBlock) = qf[r] . K[kb + t] for R rows from r0: R x kKeyVectors accumulators, each key
// vector loaded once per element of d and each query element broadcast once.
template <int R>
void score_tile(const float* qf, const Packed& c, int64_t g, int64_t kb, float* sc) {
  const int64_t d = c.d;
  vf16 acc[R][kKeyVectors] = {};
  const float* kg[kKeyVectors];
  for (int64_t u = 0; u < kKeyVectors; ++u) kg[u] = c.key_group(g, kb + u * kLanes);
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

// o[r][j0..j0 + kTileWidth * kLanes) += sum over the block's keys t of p[r][t] * V[kb + t][...] for R rows.
template <int R>
void value_tile(const float* p, const Packed& c, int64_t g, int64_t kb, int64_t j0, float* o) {
  const int64_t d = c.d;
  vf16 acc[R][kTileWidth];
  for (int r = 0; r < R; ++r)
    for (int64_t u = 0; u < kTileWidth; ++u) acc[r][u] = load16(o + r * d + j0 + u * kLanes);
  for (int64_t t = 0; t < kKeyBlock; ++t) {
    const float* vr = c.value_row(g, kb + t) + j0;
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
  std::vector<int64_t> last;
  explicit Scratch(int64_t rows, int64_t d)
      : q(rows * d), sc(rows * kKeyBlock), o(rows * d), m(rows), s(rows), last(rows) {}
};

// One work item: query positions [i0, i1) of every query head of KV head g; row r is head
// g * group + r / (i1 - i0) at position i0 + r % (i1 - i0).
template <typename T>
void attend_item(const T* q, T* out, const Packed& c, const Layout& l, int64_t g, int64_t i0, int64_t i1, float scale,
                 Scratch& w) {
  const int64_t d = c.d, width = i1 - i0, rows = l.group * width;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = g * l.group + r / width, i = i0 + r % width;
    const T* qr = q + i * l.q_stride[0] + h * l.q_stride[1];
    for (int64_t j = 0; j < d; j += kLanes) store16(w.q.data() + r * d + j, load16(qr + j) * splat(scale));
    w.last[r] = l.start + i;
  }
  std::fill(w.o.begin(), w.o.begin() + rows * d, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, -INFINITY);
  std::fill(w.s.begin(), w.s.begin() + rows, 0.0f);
  const int64_t end = l.start + i1;  // keys [0, end) reach some row of the item
  for (int64_t kb = 0; kb < end; kb += kKeyBlock) {
    int64_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows) score_tile<kTileRows>(&w.q[r * d], c, g, kb, &w.sc[r * kKeyBlock]);
    for (; r < rows; ++r) score_tile<1>(&w.q[r * d], c, g, kb, &w.sc[r * kKeyBlock]);
    online_softmax(w.sc.data(), rows, w.last.data(), kb, w.m.data(), w.s.data(), w.o.data(), d);
    for (int64_t j0 = 0; j0 < d; j0 += kTileWidth * kLanes) {
      for (r = 0; r + kTileRows <= rows; r += kTileRows)
        value_tile<kTileRows>(&w.sc[r * kKeyBlock], c, g, kb, j0, &w.o[r * d]);
      for (; r < rows; ++r) value_tile<1>(&w.sc[r * kKeyBlock], c, g, kb, j0, &w.o[r * d]);
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
template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const int64_t* idx,
                int64_t keys, const Layout& l, const Packed& c, float scale, at::Tensor& out) {
  const T *q_p = q.data_ptr<T>(), *k_p = k_pool.data_ptr<T>(), *v_p = v_pool.data_ptr<T>();
  T* o_p = out.data_ptr<T>();
  const int64_t length = q.size(0);
  const int64_t blocks = (length + kQueryBlock - 1) / kQueryBlock, items = blocks * l.kv_heads;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, c.padded / kLanes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) pack_group(k_p, v_p, idx, keys, u * kLanes, l, c);
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
  TORCH_CHECK(q_in.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "q [L, H, d], pools [S, kvh, d]");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && k_pool.strides() == v_pool.strides(),
              "the K and V pools must be laid out alike");
  TORCH_CHECK(q_in.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(),
              "q and the pools must share one dtype");
  TORCH_CHECK(k_pool.stride(2) == 1, "pool rows must be unit-stride");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor kv_idx = kv_idx_in.to(at::kLong).contiguous();
  const int64_t length = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_pool.size(1);
  const int64_t keys = kv_idx.numel();
  TORCH_CHECK(k_pool.size(2) == d && heads % kv_heads == 0, "q and the pools disagree on heads or width");
  TORCH_CHECK(d % (kTileWidth * kLanes) == 0, "the head width must be a multiple of ", kTileWidth * kLanes);
  TORCH_CHECK(start >= 0 && keys == start + length, "kv_idx must hold start + L slots");
  const int64_t* idx = kv_idx.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(idx, idx + keys, [&](int64_t i) { return i >= 0 && i < k_pool.size(0); }),
              "a KV slot outside the pools");
  const int64_t padded = (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous() &&
                  workspace.numel() >= 2 * kv_heads * padded * d,
              "the workspace must be float32 with 2 * kv_heads * padded keys * d elements");
  const Packed c{d, padded, workspace.data_ptr<float>(), workspace.data_ptr<float>() + kv_heads * padded * d};
  const Layout l{heads, kv_heads, heads / kv_heads, {q.stride(0), q.stride(1)},
                 {k_pool.stride(0), k_pool.stride(1)}, start};
  at::Tensor out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: attend_all<float>(q, k_pool, v_pool, idx, keys, l, c, static_cast<float>(scale), out); break;
    case at::kBFloat16:
      attend_all<c10::BFloat16>(q, k_pool, v_pool, idx, keys, l, c, static_cast<float>(scale), out);
      break;
    case at::kHalf: attend_all<c10::Half>(q, k_pool, v_pool, idx, keys, l, c, static_cast<float>(scale), out); break;
    default: TORCH_CHECK(false, "attn_prefill takes float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) { m.impl("attn_prefill", hyssm_cpu::attn_prefill); }
