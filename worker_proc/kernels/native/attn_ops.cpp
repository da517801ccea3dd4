// Decode attention: one query row per request and head over the request's context, read from the KV
// pools at its slots. Rules that hold:
// - a request's keys and values are read where they lie in the pools (no gathered copy, no padding:
//   request b reads exactly lengths[b] slots of its row of kv_idx), once per KV head for all the query
//   heads that share it;
// - scores, the softmax and the weighted sum of values are float32 (exact products of the model dtype's
//   values); the output is rounded once to the model dtype;
// - the threads split the (request, KV head) pairs.
#include <torch/library.h>

#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

struct DecodeShape {
  int64_t d;
  int64_t q_stride[2];   // q / out rows: request, head
  int64_t kv_stride[2];  // pools: slot, head
};

// Request b's query heads h0..h0+group-1 attend over slots idx[0..len) of KV head g.
template <typename T>
void attend_group(const T* q, const T* k_pool, const T* v_pool, const int64_t* idx, int64_t len, int64_t g,
                  int64_t group, float scale, const DecodeShape& s, T* out, std::vector<float>& buf) {
  const int64_t d = s.d, h0 = g * group;
  buf.assign(group * d * 3 + group * len, 0.0f);
  float *qf = buf.data(), *row = qf + group * d, *acc = row + d, *p = acc + group * d;
  for (int64_t i = 0; i < group; ++i) {
    const T* qi = q + (h0 + i) * s.q_stride[1];
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) qf[i * d + j] = to_f(qi[j]) * scale;
  }
  for (int64_t t = 0; t < len; ++t) {
    const T* kr = k_pool + idx[t] * s.kv_stride[0] + g * s.kv_stride[1];
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) row[j] = to_f(kr[j]);
    for (int64_t i = 0; i < group; ++i) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < d; ++j) dot += qf[i * d + j] * row[j];
      p[i * len + t] = dot;
    }
  }
  std::vector<float> total(group);
  for (int64_t i = 0; i < group; ++i) {
    float* pi = p + i * len;
    const float top = *std::max_element(pi, pi + len);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      pi[t] = exp_approx(pi[t] - top);
      sum += pi[t];
    }
    total[i] = sum;
  }
  for (int64_t t = 0; t < len; ++t) {
    const T* vr = v_pool + idx[t] * s.kv_stride[0] + g * s.kv_stride[1];
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) row[j] = to_f(vr[j]);
    for (int64_t i = 0; i < group; ++i) {
      const float w = p[i * len + t];
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) acc[i * d + j] += w * row[j];
    }
  }
  for (int64_t i = 0; i < group; ++i) {
    T* oi = out + (h0 + i) * s.q_stride[1];
    const float inv = 1.0f / total[i];
    for (int64_t j = 0; j < d; ++j) oi[j] = from_f<T>(acc[i * d + j] * inv);
  }
}

at::Tensor attn_decode(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                       const at::Tensor& kv_idx_in, const at::Tensor& lengths_in, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "q [B, H, d], pools [S, kvh, d]");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && k_pool.strides() == v_pool.strides(),
              "the K and V pools must be laid out alike");
  TORCH_CHECK(q_in.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(),
              "q and the pools must share one dtype");
  TORCH_CHECK(k_pool.stride(2) == 1, "pool rows must be unit-stride");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor kv_idx = kv_idx_in.to(at::kLong).contiguous(), lengths = lengths_in.to(at::kLong).contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == d && heads % kv_heads == 0, "q and the pools disagree on heads or width");
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
  const int64_t group = heads / kv_heads, width = kv_idx.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attn_decode", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const scalar_t *q_p = q.data_ptr<scalar_t>(), *k_p = k_pool.data_ptr<scalar_t>();
      const scalar_t* v_p = v_pool.data_ptr<scalar_t>();
      scalar_t* o_p = out.data_ptr<scalar_t>();
      const int64_t* idx_p = kv_idx.data_ptr<int64_t>();
      at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> buf;
        for (int64_t u = begin; u < end; ++u) {
          const int64_t b = u / kv_heads, g = u % kv_heads;
          attend_group(q_p + b * s.q_stride[0], k_p, v_p, idx_p + b * width, len_p[b], g, group,
                       static_cast<float>(scale), s, o_p + b * s.q_stride[0], buf);
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
