// Mamba1's selective scan (worker_proc.kernels.selective_scan states it) over prefill segments or one token
// per state slot. Per channel c and state index n, with step = softplus(dt[c] + dt_bias[c]):
//     state[c, n] <- exp(step a[c, n]) state[c, n] + step x[c] B[n];   y[c] = sum_n state[c, n] C[n] + d[c] x[c].
// Rules that hold:
// - every input is float32 (the caller converts); the pool is [S, D, 1, N] (a channel is a "head" of one row),
//   each slot's channel row read in its storage (float32 in place, bfloat16 or int8 through a buffer) and
//   written back once per call; a row of padding slot 0 runs from a zero state and is never written;
// - the threads split the (segment, block of channels) tasks, each of which owns its channels' state rows,
//   so the result does not depend on the thread count;
// - `lengths` empty: one token per slot (row r advances slots[r]); else segment i is the next lengths[i] rows
//   and advances slots[i].
#include <torch/library.h>

#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

constexpr int64_t CHANNEL_BLOCK = 64;  // channels of one task

at::Tensor selective_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& b, const at::Tensor& c,
                          const at::Tensor& a, const at::Tensor& d, const at::Tensor& dt_bias, at::Tensor pool,
                          const c10::optional<at::Tensor>& pool_scale, const at::Tensor& slots,
                          at::IntArrayRef lengths) {
  TORCH_CHECK(x.dim() == 2 && dt.sizes() == x.sizes() && b.dim() == 2 && c.sizes() == b.sizes() &&
                  b.size(0) == x.size(0) && a.dim() == 2 && a.size(0) == x.size(1) && a.size(1) == b.size(1),
              "selective_scan takes x, dt [T, D], b, c [T, N], a [D, N]");
  for (const at::Tensor* t : {&x, &dt, &b, &c, &a, &d, &dt_bias}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "selective_scan's inputs are contiguous float32");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "slots must be int64");
  const StatePool states(pool, pool_scale);
  const int64_t rows = x.size(0), channels = x.size(1), n = b.size(1);
  TORCH_CHECK(states.heads == channels && states.p == 1 && states.n == n, "state pool is not [S, D, 1, N]");
  std::vector<int64_t> starts, lens, seg_slot;
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  if (lengths.empty()) {
    TORCH_CHECK(slots.size(0) == rows, "one slot per row");
    for (int64_t r = 0; r < rows; ++r) starts.push_back(r), lens.push_back(1), seg_slot.push_back(slot_p[r]);
  } else {
    TORCH_CHECK(slots.size(0) == static_cast<int64_t>(lengths.size()), "one slot per segment");
    int64_t start = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      starts.push_back(start), lens.push_back(lengths[i]), seg_slot.push_back(slot_p[i]);
      start += lengths[i];
    }
    TORCH_CHECK(start == rows, "the segments' lengths do not add up to the rows");
  }
  at::Tensor out = at::empty({rows, channels}, x.options());
  const float *x_p = x.data_ptr<float>(), *dt_p = dt.data_ptr<float>(), *b_p = b.data_ptr<float>();
  const float *c_p = c.data_ptr<float>(), *a_p = a.data_ptr<float>(), *d_p = d.data_ptr<float>();
  const float* bias_p = dt_bias.data_ptr<float>();
  float* y_p = out.data_ptr<float>();
  const int64_t blocks = (channels + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK;
  const int64_t segments = static_cast<int64_t>(starts.size());
  at::parallel_for(0, segments * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n), padding(n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seg = task / blocks, c0 = (task % blocks) * CHANNEL_BLOCK;
      const int64_t c1 = std::min(channels, c0 + CHANNEL_BLOCK), slot = seg_slot[seg];
      for (int64_t ch = c0; ch < c1; ++ch) {
        std::fill(padding.begin(), padding.end(), 0.0f);
        float* s = slot == 0 ? padding.data() : states.load(slot, ch, buf.data());
        const float* ar = a_p + ch * n;
        for (int64_t t = starts[seg]; t < starts[seg] + lens[seg]; ++t) {
          const float step = softplus(dt_p[t * channels + ch] + bias_p[ch]);
          const float xv = x_p[t * channels + ch], dx = step * xv;
          const float *br = b_p + t * n, *cr = c_p + t * n;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t j = 0; j < n; ++j) {
            s[j] = exp_approx(step * ar[j]) * s[j] + dx * br[j];
            acc += s[j] * cr[j];
          }
          y_p[t * channels + ch] = acc + d_p[ch] * xv;
        }
        if (slot != 0) states.store(slot, ch, s);
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) { m.impl("selective_scan", hyssm_cpu::selective_scan); }
