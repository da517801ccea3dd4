// Decode attention: one query row per request and head over the request's context, read from the KV
// pools at its slots. Rules that hold:
// - a request's keys and values are read where they lie in the pools (no gathered copy, no padding:
//   request b reads exactly lengths[b] slots of its row of kv_idx), each slot's row once for all the
//   KV heads and the query heads that share them;
// - scores, the softmax and the weighted sum of values are float32 (exact products of the model dtype's
//   values); the output is rounded once to the model dtype;
// - a context is cut into chunks of kKeyChunk keys, and the threads split the (request, chunk) pairs:
//   each chunk's softmax is taken against its own maximum, and the chunks of a request are then
//   combined against the largest (as flash-decoding does), so that one long context uses every thread.
#include <torch/library.h>

#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

struct DecodeShape {
  int64_t d;
  int64_t q_stride[2];   // q / out rows: request, head
  int64_t kv_stride[2];  // pools: slot, head
};

constexpr int64_t kValueKeys = 4;  // keys whose values one pass adds into a head's accumulators
constexpr int64_t kKeyChunk = 256;  // keys of one work item
template <typename T>
constexpr bool kWidened = !std::is_same_v<T, double>;  // a model dtype, which `load16` widens

constexpr int64_t kPrefetchKeys = 32;  // how far ahead of its use a pass asks for a slot's row

// Every cache line of a slot's row of `width` values, requested ahead of its use: a long context's rows
// lie across many pages, and the hardware's prefetchers stop at each page's end.
template <typename T>
inline void prefetch_row(const T* row, int64_t width) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(bytes + b);
}

struct Heads {
  int64_t heads, kv_heads, group;  // query heads, KV heads, query heads per KV head
};

// p[h * n + t] = qf[h] . K_g(h)[idx[t]] for every query head h (qf: float32, scale applied); the keys
// outermost, so that each slot's row is read once, whole.
template <typename T>
void scores(const float* qf, const T* k_pool, const int64_t* idx, int64_t n, const Heads& hd,
            const DecodeShape& s, float* p, float* row) {
  const int64_t d = s.d;
  if constexpr (kWidened<T>) if (d % kLanes == 0) {
    // each dot product keeps kLanes partial sums, added once per key and head: a reduction added in
    // one chain per key waits on every add in turn
    for (int64_t t = 0; t < n; ++t) {
      if (t + kPrefetchKeys < n)
        prefetch_row(k_pool + idx[t + kPrefetchKeys] * s.kv_stride[0], hd.kv_heads * s.kv_stride[1]);
      const T* kr = k_pool + idx[t] * s.kv_stride[0];
      for (int64_t h = 0; h < hd.heads; ++h) {
        const T* kg = kr + (h / hd.group) * s.kv_stride[1];
        const float* qh = qf + h * d;
        vf16 acc = load16(qh) * load16(kg);
        for (int64_t j = kLanes; j < d; j += kLanes) acc = load16(qh + j) * load16(kg + j) + acc;
        p[h * n + t] = sum16(acc);
      }
    }
    return;
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < hd.kv_heads; ++g) {
      const T* kg = k_pool + idx[t] * s.kv_stride[0] + g * s.kv_stride[1];
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) row[j] = to_f(kg[j]);
      for (int64_t h = g * hd.group; h < (g + 1) * hd.group; ++h) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < d; ++j) dot += qf[h * d + j] * row[j];
        p[h * n + t] = dot;
      }
    }
  }
}

// acc[h] += sum over t of p[h * n + t] * V_g(h)[idx[t]] for every query head h.
template <typename T>
void weighted_values(const float* p, const T* v_pool, const int64_t* idx, int64_t n, const Heads& hd,
                     const DecodeShape& s, float* acc, float* row) {
  const int64_t d = s.d;
  int64_t t = 0;
  if constexpr (kWidened<T>) if (d % kLanes == 0) {
    // kValueKeys keys per pass: each accumulator vector is loaded and stored once per pass, not per key
    for (; t + kValueKeys <= n; t += kValueKeys) {
      for (int64_t u = t + kPrefetchKeys; u < std::min(n, t + kPrefetchKeys + kValueKeys); ++u)
        prefetch_row(v_pool + idx[u] * s.kv_stride[0], hd.kv_heads * s.kv_stride[1]);
      for (int64_t g = 0; g < hd.kv_heads; ++g) {
        const T* vr[kValueKeys];
        for (int64_t u = 0; u < kValueKeys; ++u) vr[u] = v_pool + idx[t + u] * s.kv_stride[0] + g * s.kv_stride[1];
        for (int64_t j = 0; j < d; j += kLanes) {
          vf16 vv[kValueKeys];
          for (int64_t u = 0; u < kValueKeys; ++u) vv[u] = load16(vr[u] + j);
          for (int64_t h = g * hd.group; h < (g + 1) * hd.group; ++h) {
            const float* w = p + h * n + t;
            vf16 a = load16(acc + h * d + j);
            for (int64_t u = 0; u < kValueKeys; ++u) a = splat(w[u]) * vv[u] + a;
            store16(acc + h * d + j, a);
          }
        }
      }
    }
  }
  for (; t < n; ++t) {
    for (int64_t g = 0; g < hd.kv_heads; ++g) {
      const T* vg = v_pool + idx[t] * s.kv_stride[0] + g * s.kv_stride[1];
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) row[j] = to_f(vg[j]);
      for (int64_t h = g * hd.group; h < (g + 1) * hd.group; ++h) {
        const float w = p[h * n + t];
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) acc[h * d + j] += w * row[j];
      }
    }
  }
}

// One chunk of one request's keys (slots idx[0..n)): per query head its scores' maximum top[h], the
// sum of exp(score - top[h]) total[h] and those weights' sum of values acc[h * d ..].
template <typename T>
void attend_chunk(const T* q, const T* k_pool, const T* v_pool, const int64_t* idx, int64_t n, float scale,
                  const Heads& hd, const DecodeShape& s, float* top, float* total, float* acc,
                  std::vector<float>& buf) {
  const int64_t d = s.d;
  buf.assign(hd.heads * d + d + hd.heads * n, 0.0f);
  float *qf = buf.data(), *row = qf + hd.heads * d, *p = row + d;
  for (int64_t h = 0; h < hd.heads; ++h) {
    const T* qh = q + h * s.q_stride[1];
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) qf[h * d + j] = to_f(qh[j]) * scale;
  }
  scores(qf, k_pool, idx, n, hd, s, p, row);
  for (int64_t h = 0; h < hd.heads; ++h) {
    float* ph = p + h * n;
    const float m = *std::max_element(ph, ph + n);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      ph[t] = exp_approx(ph[t] - m);
      sum += ph[t];
    }
    top[h] = m;
    total[h] = sum;
  }
  std::fill(acc, acc + hd.heads * d, 0.0f);
  weighted_values(p, v_pool, idx, n, hd, s, acc, row);
}

// Request b's output from its `chunks` partial results (attend_chunk's, chunk after chunk).
template <typename T>
void combine_chunks(const float* top, const float* total, const float* acc, int64_t chunks, const Heads& hd,
                    const DecodeShape& s, T* out) {
  const int64_t d = s.d, heads = hd.heads;
  std::vector<float> o(d);
  for (int64_t h = 0; h < heads; ++h) {
    float m = top[h];
    for (int64_t c = 1; c < chunks; ++c) m = std::max(m, top[c * heads + h]);
    float sum = 0.0f;
    std::fill(o.begin(), o.end(), 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float w = exp_approx(top[c * heads + h] - m);
      sum += w * total[c * heads + h];
      const float* a = acc + (c * heads + h) * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) o[j] += w * a[j];
    }
    T* oh = out + h * s.q_stride[1];
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < d; ++j) oh[j] = from_f<T>(o[j] * inv);
  }
}

at::Tensor attn_decode(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                       const at::Tensor& kv_idx_in, const at::Tensor& lengths_in, double scale) {
  check_attention(q_in, k_pool, v_pool);
  const at::Tensor q = q_in.contiguous();
  const at::Tensor kv_idx = kv_idx_in.to(at::kLong).contiguous(), lengths = lengths_in.to(at::kLong).contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_pool.size(1);
  TORCH_CHECK(kv_idx.dim() == 2 && kv_idx.size(0) == batch && lengths.numel() == batch,
              "kv_idx [B, T] and lengths [B]");
  const int64_t* len_p = lengths.data_ptr<int64_t>();
  const int64_t* all_idx = kv_idx.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len_p[b] >= 1 && len_p[b] <= kv_idx.size(1), "a length outside 1..T");
    const int64_t* row = all_idx + b * kv_idx.size(1);
    TORCH_CHECK(std::all_of(row, row + len_p[b], [&](int64_t i) { return i >= 0 && i < k_pool.size(0); }),
                "a KV slot outside the pools");
  }
  at::Tensor out = at::empty_like(q);
  const DecodeShape s{d, {q.stride(0), q.stride(1)}, {k_pool.stride(0), k_pool.stride(1)}};
  const Heads hd{heads, kv_heads, heads / kv_heads};
  const int64_t width = kv_idx.size(1);
  std::vector<int64_t> first(batch + 1, 0);  // request b's chunks are [first[b], first[b + 1])
  for (int64_t b = 0; b < batch; ++b) first[b + 1] = first[b] + (len_p[b] + kKeyChunk - 1) / kKeyChunk;
  const int64_t items = first[batch];
  std::vector<float> top(items * heads), total(items * heads), acc(items * heads * d);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attn_decode", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const scalar_t *q_p = q.data_ptr<scalar_t>(), *k_p = k_pool.data_ptr<scalar_t>();
      const scalar_t* v_p = v_pool.data_ptr<scalar_t>();
      scalar_t* o_p = out.data_ptr<scalar_t>();
      const int64_t* idx_p = kv_idx.data_ptr<int64_t>();
      at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> buf;
        for (int64_t u = begin; u < end; ++u) {
          const int64_t b = std::upper_bound(first.begin(), first.end(), u) - first.begin() - 1;
          const int64_t t0 = (u - first[b]) * kKeyChunk, n = std::min(kKeyChunk, len_p[b] - t0);
          attend_chunk(q_p + b * s.q_stride[0], k_p, v_p, idx_p + b * width + t0, n, static_cast<float>(scale), hd,
                       s, top.data() + u * heads, total.data() + u * heads, acc.data() + u * heads * d, buf);
        }
      });
      at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const int64_t u = first[b];
          combine_chunks(top.data() + u * heads, total.data() + u * heads, acc.data() + u * heads * d,
                         first[b + 1] - u, hd, s, o_p + b * s.q_stride[0]);
        }
      });
    } else {
      TORCH_CHECK(false, "float64 is not a model dtype");
    }
  });
  return out;
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) { m.impl("attn_decode", hyssm_cpu::attn_decode); }
