// The Mamba scan kernels: a decode step (conv + scan of one token per slot) and the prefill conv and
// scan over every segment of a step; the op schemas of the whole library (cpu_common.h states the rules).

#include <torch/library.h>

#include "block_scan.h"
#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

constexpr int64_t CONV_BLOCK = 128;  // channels of one decode conv task

// The conv step and the SSD state step of one token per slot (see mamba_decode below).
template <typename T>
at::Tensor mamba_decode_impl(const at::Tensor& xbc, const at::Tensor& dt, at::Tensor& conv_pool,
                             const StatePool& states, const at::Tensor& slots, const at::Tensor& conv_w,
                             const c10::optional<at::Tensor>& conv_b, const at::Tensor& a, const at::Tensor& d,
                             const at::Tensor& dt_bias, const c10::optional<at::Tensor>& head_group,
                             double dt_min, double dt_max, int64_t groups) {
  const int64_t rows = xbc.size(0), cd = xbc.size(1), k = conv_w.size(1), heads = dt.size(1);
  const int64_t p = states.p, n = states.n, inner = heads * p, per_group = heads / groups;
  TORCH_CHECK(cd == inner + 2 * groups * n, "xBC width ", cd, " is not heads * head_dim + 2 * groups * d_state");
  TORCH_CHECK(heads % groups == 0 || head_group.has_value(), "heads must spread evenly over the groups");
  TORCH_CHECK(conv_pool.size(1) == cd && conv_pool.size(2) == k - 1, "conv pool does not match the conv weight");
  TORCH_CHECK(states.heads == heads, "state pool is not [S, heads, head_dim, d_state]");
  const T* xbc_p = xbc.data_ptr<T>();
  const T* dt_p = dt.data_ptr<T>();
  const int64_t xbc_rs = xbc.stride(0), dt_rs = dt.stride(0);
  T* conv_p = conv_pool.data_ptr<T>();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const T* w_p = conv_w.data_ptr<T>();
  const T* b_p = conv_b.has_value() ? conv_b->data_ptr<T>() : nullptr;
  at::Tensor a32 = a.to(at::kFloat).contiguous(), d32 = d.to(at::kFloat).contiguous();
  at::Tensor bias32 = dt_bias.to(at::kFloat).contiguous();
  const float *a_p = a32.data_ptr<float>(), *d_p = d32.data_ptr<float>(), *bias_p = bias32.data_ptr<float>();
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  std::vector<int64_t> group_of(heads);
  for (int64_t h = 0; h < heads; ++h) group_of[h] = h / std::max<int64_t>(per_group, 1);
  if (head_group.has_value()) {
    at::Tensor hg = head_group->to(at::kLong).contiguous();
    TORCH_CHECK(hg.numel() == heads, "head_group must name one group per head");
    for (int64_t h = 0; h < heads; ++h) group_of[h] = hg.data_ptr<int64_t>()[h];
  }

  // 1. conv: out = silu(sum(window * w) + b) rounded to T; the window shifts in the new input. A task is
  // CONV_BLOCK channels of every row: their weights and taps are gathered into float32 lanes, then the
  // sums and the SiLU run as vectors (per channel, a scalar SiLU is one long chain of dependent
  // operations, which left the conv as slow as the scan of the states).
  at::Tensor conv_out = at::empty({rows, cd}, xbc.options().dtype(at::kFloat));
  float* co_p = conv_out.data_ptr<float>();
  const int64_t blocks = (cd + CONV_BLOCK - 1) / CONV_BLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(k * CONV_BLOCK), taps(k * CONV_BLOCK), bias(CONV_BLOCK), act(CONV_BLOCK);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t c0 = u * CONV_BLOCK, width = std::min(CONV_BLOCK, cd - c0);
      for (int64_t c = 0; c < width; ++c) {
        for (int64_t j = 0; j < k; ++j) weights[j * CONV_BLOCK + c] = to_f(w_p[(c0 + c) * k + j]);
        if (b_p != nullptr) bias[c] = to_f(b_p[c0 + c]);
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* win = conv_p + (slot_p[r] * cd + c0) * (k - 1);
        const T* xr = xbc_p + r * xbc_rs + c0;
        for (int64_t c = 0; c < width; ++c) {
          T* wc = win + c * (k - 1);
          for (int64_t j = 0; j < k - 1; ++j) taps[j * CONV_BLOCK + c] = to_f(wc[j]);
          taps[(k - 1) * CONV_BLOCK + c] = to_f(xr[c]);
          for (int64_t j = 0; j + 1 < k - 1; ++j) wc[j] = wc[j + 1];
          if (k > 1) wc[k - 2] = xr[c];
        }
        int64_t c = 0;
        for (; c + kLanes <= width; c += kLanes) {
          vf16 acc{};
          for (int64_t j = 0; j < k; ++j)
            acc = load16(&taps[j * CONV_BLOCK + c]) * load16(&weights[j * CONV_BLOCK + c]) + acc;
          if (b_p != nullptr) acc = acc + load16(&bias[c]);
          store16(&act[c], acc / (splat(1.0f) + exp16(-acc)));
        }
        for (; c < width; ++c) {
          float acc = 0.0f;
          for (int64_t j = 0; j < k; ++j) acc += taps[j * CONV_BLOCK + c] * weights[j * CONV_BLOCK + c];
          if (b_p != nullptr) acc += bias[c];
          act[c] = silu(acc);
        }
        float* out = co_p + r * cd + c0;
        for (c = 0; c < width; ++c) out[c] = round_to<T>(act[c]);
      }
    }
  });

  // 2. scan: state = state * exp(dt a) + (dt x) B; y = state . C + D x, one pass over each state row
  at::Tensor y = at::empty({rows, heads, p}, xbc.options().dtype(at::kFloat));
  float* y_p = y.data_ptr<float>();
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(states.direct() ? 0 : p * n);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / heads, h = i % heads, g = group_of[h];
      float step = softplus(to_f(dt_p[r * dt_rs + h]) + bias_p[h]);
      step = std::min(std::max(step, lo), hi);
      const float decay = std::exp(step * a_p[h]);
      const float* row_in = co_p + r * cd;
      const float* x = row_in + h * p;
      const float* bv = row_in + inner + g * n;
      const float* cv = row_in + inner + groups * n + g * n;
      float* st = states.load(slot_p[r], h, buf.data());
      advance_head_streaming(st, p, n, decay, step, x, bv, cv, d_p[h], y_p + (r * heads + h) * p);
      states.store(slot_p[r], h, st);
    }
  });
  return y;
}

at::Tensor mamba_decode(const at::Tensor& xbc, const at::Tensor& dt, at::Tensor conv_pool, at::Tensor ssm_pool,
                        const c10::optional<at::Tensor>& ssm_scale, const at::Tensor& slots, const at::Tensor& conv_w, const c10::optional<at::Tensor>& conv_b,
                        const at::Tensor& a, const at::Tensor& d, const at::Tensor& dt_bias,
                        const c10::optional<at::Tensor>& head_group, double dt_min, double dt_max, int64_t groups) {
  check_rows(xbc, "xBC");
  check_rows(dt, "dt");
  TORCH_CHECK(conv_pool.is_contiguous() && conv_w.is_contiguous(), "conv pool and weight must be contiguous");
  const StatePool states(ssm_pool, ssm_scale);
  TORCH_CHECK(xbc.scalar_type() == conv_pool.scalar_type() && xbc.scalar_type() == conv_w.scalar_type() &&
                  xbc.scalar_type() == dt.scalar_type(),
              "xBC, dt, conv pool and conv weight must share one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be int64");
  at::Tensor w = conv_w.contiguous();
  c10::optional<at::Tensor> b;
  if (conv_b.has_value()) b = conv_b->contiguous();
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xbc.scalar_type(), "mamba_decode", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      out = mamba_decode_impl<scalar_t>(xbc, dt, conv_pool, states, slots, w, b, a, d, dt_bias, head_group,
                                        dt_min, dt_max, groups);
    } else {
      TORCH_CHECK(false, "float64 is not a model dtype");
    }
  });
  return out;
}

// The depthwise causal conv + SiLU (without `act`: the conv alone, a short convolution's) of prefill
// segments: segment i (`lengths`, `slots`) continues from its slot's window of the K-1 inputs before it.
// x [T, Cd] (any row stride, unit-stride channels), weight [Cd, K], bias [Cd] or none, conv_pool
// [S, Cd, K-1], all in the model dtype. Returns [T, Cd] in it: the sum in float32, rounded to the dtype
// before and after the SiLU (as the torch path's conv and activation round); each slot's window ends as
// the segment's last K-1 inputs.
template <typename T>
at::Tensor conv_prefill_impl(const at::Tensor& x, at::Tensor& conv_pool, const std::vector<int64_t>& lengths,
                             const std::vector<int64_t>& slots, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, bool act) {
  const int64_t total = x.size(0), cd = x.size(1), k = weight.size(1), segs = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> starts(segs + 1, 0);
  for (int64_t i = 0; i < segs; ++i) starts[i + 1] = starts[i] + lengths[i];
  TORCH_CHECK(starts[segs] == total, "segment lengths do not add up to the rows");
  // the weight as float32 [K, Cd] and the bias as float32 (zeros without one), made here: one small pass
  // instead of three dispatched ops per call
  std::vector<float> wt(k * cd), b32(cd, 0.0f);
  const at::Tensor wc = weight.contiguous();
  const T* wsrc = wc.data_ptr<T>();
  for (int64_t c = 0; c < cd; ++c)
    for (int64_t j = 0; j < k; ++j) wt[j * cd + c] = to_f(wsrc[c * k + j]);
  if (bias.has_value()) {
    const at::Tensor bc = bias->contiguous();
    for (int64_t c = 0; c < cd; ++c) b32[c] = to_f(bc.data_ptr<T>()[c]);
  }
  const float *w_p = wt.data(), *b_p = b32.data();
  const T* x_p = x.data_ptr<T>();
  T* pool_p = conv_pool.data_ptr<T>();
  // 128 channels a task: a Mamba2 conv width of 1792 is 14 tasks, which two or seven threads share evenly
  const int64_t xs = x.stride(0), block = 128, blocks = (cd + block - 1) / block;
  at::Tensor out = at::empty({total, cd}, x.options().memory_format(at::MemoryFormat::Contiguous));
  T* o_p = out.data_ptr<T>();
  at::parallel_for(0, segs * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> prev((k - 1) * block);  // the window before the segment, [K-1, block]
    std::vector<float> acc(block);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t sg = u / blocks, c0 = (u % blocks) * block, width = std::min(block, cd - c0);
      const int64_t start = starts[sg], len = lengths[sg];
      T* win = pool_p + slots[sg] * cd * (k - 1);
      for (int64_t c = 0; c < width; ++c)
        for (int64_t j = 0; j < k - 1; ++j) prev[j * block + c] = win[(c0 + c) * (k - 1) + j];
      // input i of the segment's extended sequence (i < K-1: the window) for channels c0..
      auto input = [&](int64_t i) -> const T* {
        return i < k - 1 ? prev.data() + i * block : x_p + (start + i - (k - 1)) * xs + c0;
      };
      for (int64_t t = 0; t < len; ++t) {
        T* orow = o_p + (start + t) * cd + c0;
        if (k == 4) {  // the families' width: the four taps summed in one register
          const T *in0 = input(t), *in1 = input(t + 1), *in2 = input(t + 2), *in3 = input(t + 3);
          const float *w0 = w_p + c0, *w1 = w0 + cd, *w2 = w1 + cd, *w3 = w2 + cd, *bias_c = b_p + c0;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) {
            float sum = bias_c[c] + w0[c] * to_f(in0[c]);
            sum += w1[c] * to_f(in1[c]);
            sum += w2[c] * to_f(in2[c]);
            sum += w3[c] * to_f(in3[c]);
            const float r = round_to<T>(sum);
            orow[c] = from_f<T>(act ? silu(r) : r);
          }
          continue;
        }
        for (int64_t c = 0; c < width; ++c) acc[c] = b_p[c0 + c];
        for (int64_t j = 0; j < k; ++j) {
          const T* in = input(t + j);
          const float* wj = w_p + j * cd + c0;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) acc[c] += wj[c] * to_f(in[c]);
        }
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) {
          const float r = round_to<T>(acc[c]);
          orow[c] = from_f<T>(act ? silu(r) : r);
        }
      }
      for (int64_t j = 0; j < k - 1; ++j) {
        const T* row = input(len + j);
        for (int64_t c = 0; c < width; ++c) win[(c0 + c) * (k - 1) + j] = row[c];
      }
    }
  });
  return out;
}

at::Tensor conv_prefill(const at::Tensor& x, at::Tensor conv_pool, at::IntArrayRef lengths, at::IntArrayRef slots,
                        const at::Tensor& weight, const c10::optional<at::Tensor>& bias, bool silu) {
  check_rows(x, "x");
  TORCH_CHECK(conv_pool.is_contiguous() && conv_pool.size(1) == x.size(1) && conv_pool.size(2) == weight.size(1) - 1,
              "conv pool must be contiguous [S, Cd, K-1]");
  TORCH_CHECK(x.scalar_type() == conv_pool.scalar_type() && weight.size(0) == x.size(1),
              "x and the conv pool must share one dtype; weight [Cd, K]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && (!bias.has_value() || bias->scalar_type() == x.scalar_type()),
              "the conv weight and bias must be in x's dtype");
  TORCH_CHECK(lengths.size() == slots.size(), "one slot per segment");
  std::vector<int64_t> lens(lengths.begin(), lengths.end()), sl(slots.begin(), slots.end());
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "conv_prefill", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      out = conv_prefill_impl<scalar_t>(x, conv_pool, lens, sl, weight, bias, silu);
    } else {
      TORCH_CHECK(false, "float64 is not a model dtype");
    }
  });
  return out;
}

// The SSD scan of prefill segments: for each segment (`lengths`, `slots`), each head h and each row q of
// its state, state = state * exp(dt a) + (dt x) B and y = state . C + D x at every position; a segment's
// whole blocks in `scan_block` where `block_scan_fits` and it has BLOCK_MIN_TOKENS (block_scan.h), the
// rest token by token in `advance_head`. x [T, H, P], dt [T, H] raw, b, c [T, G, N] (head h reads group h / (H / G)), in the model
// dtype with a unit-stride last dim; they are read where they lie and widened as they are read (no float32
// copies: a block's B and C once for all heads of their group, `block_gram`). Returns
// y [T, H, P] float32; each segment's slot of the float32 pool ends at the state after its last token.
// The grams and the scan of `ssd_prefill` over x, b, c in the model dtype T, read where they lie (x [T, H, P],
// b, c [T, G, N], unit-stride last dims) and widened as they are read.
template <typename T>
void ssd_prefill_scan(const at::Tensor& x, const at::Tensor& b, const at::Tensor& c, const StatePool& states,
                      const std::vector<int64_t>& starts, const std::vector<int64_t>& slot_of, const float* step_p,
                      const float* decay_p, const float* a_p, const float* d_p, float* y_p) {
  const int64_t heads = x.size(1), p = x.size(2), groups = b.size(1), n = b.size(2), per_group = heads / groups;
  const int64_t segs = static_cast<int64_t>(slot_of.size());
  const T *x_p = x.data_ptr<T>(), *b_p = b.data_ptr<T>(), *c_p = c.data_ptr<T>();
  const int64_t xs = x.stride(0), xh = x.stride(1), bs = b.stride(0), bg = b.stride(1);
  TORCH_CHECK(c.stride(0) == bs && c.stride(1) == bg, "B and C must be laid out alike");
  // the whole blocks of every segment long enough for them, and their C . B grams
  std::vector<int64_t> whole(segs, 0), block_rows, first_block(segs + 1, 0);
  for (int64_t sg = 0; sg < segs; ++sg) {
    const int64_t len = starts[sg + 1] - starts[sg];
    if (block_scan_fits(p, n) && len >= BLOCK_MIN_TOKENS) whole[sg] = len / BLOCK * BLOCK;
    for (int64_t t = 0; t < whole[sg]; t += BLOCK) block_rows.push_back(starts[sg] + t);
    first_block[sg + 1] = static_cast<int64_t>(block_rows.size());
  }
  const int64_t block_groups = static_cast<int64_t>(block_rows.size()) * groups;
  std::vector<float> gram(block_groups * BLOCK * BLOCK), packed(block_groups * n * 2 * BLOCK);
  if (!block_rows.empty()) block_gram(b_p, c_p, bs, bg, groups, n, block_rows, gram.data(), packed.data());
  at::parallel_for(0, segs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(states.direct() ? 0 : p * n), transposed(p * n), xf(p), bf(n), cf(n);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t sg = u / heads, h = u % heads, g = h / per_group;
      float* st = states.load(slot_of[sg], h, buf.data());
      int64_t t = starts[sg];
      if (whole[sg] > 0) {
        transpose_state(st, p, n, transposed.data());
        for (int64_t blk = first_block[sg]; blk < first_block[sg + 1]; ++blk) {
          const int64_t t0 = block_rows[blk];
          const BlockInput<T> in{x_p + t0 * xs + h * xh, xs, step_p + t0 * heads + h, heads,
                                 packed.data() + (blk * groups + g) * n * 2 * BLOCK,
                                 gram.data() + (blk * groups + g) * BLOCK * BLOCK};
          scan_block(transposed.data(), p, n, a_p[h], d_p[h], in, y_p + (t0 * heads + h) * p, heads * p);
        }
        transpose_state(transposed.data(), n, p, st);
        t += whole[sg];
      }
      for (; t < starts[sg + 1]; ++t) {  // token by token: the row's inputs widened first
        const int64_t th = t * heads + h;
        const T *xr = x_p + t * xs + h * xh, *br = b_p + t * bs + g * bg, *cr = c_p + t * bs + g * bg;
        for (int64_t q = 0; q < p; ++q) xf[q] = to_f(xr[q]);
        for (int64_t j = 0; j < n; ++j) {
          bf[j] = to_f(br[j]);
          cf[j] = to_f(cr[j]);
        }
        advance_head(st, p, n, decay_p[th], step_p[th], xf.data(), bf.data(), cf.data(), d_p[h], y_p + th * p);
      }
      states.store(slot_of[sg], h, st);
    }
  });
}

at::Tensor ssd_prefill(const at::Tensor& x_in, const at::Tensor& dt, const at::Tensor& b_in, const at::Tensor& c_in,
                       at::Tensor ssm_pool, const c10::optional<at::Tensor>& ssm_scale, at::IntArrayRef lengths, at::IntArrayRef slots, const at::Tensor& a,
                       const at::Tensor& d, const at::Tensor& dt_bias, double dt_min, double dt_max) {
  TORCH_CHECK(x_in.dim() == 3 && dt.dim() == 2 && b_in.dim() == 3 && c_in.dim() == 3,
              "x [T, H, P], dt [T, H], B/C [T, G, N]");
  TORCH_CHECK(b_in.sizes() == c_in.sizes(), "B and C must have one shape");
  TORCH_CHECK(x_in.scalar_type() == b_in.scalar_type() && x_in.scalar_type() == c_in.scalar_type(),
              "x, B and C must share one dtype");
  const StatePool states(ssm_pool, ssm_scale);
  TORCH_CHECK(lengths.size() == slots.size(), "one slot per segment");
  // read in place where the last dims are unit-stride (B and C alike), else from a contiguous copy
  const bool bc_alike = b_in.stride(0) == c_in.stride(0) && b_in.stride(1) == c_in.stride(1);
  const at::Tensor x = x_in.stride(2) == 1 ? x_in : x_in.contiguous();
  const at::Tensor b = b_in.stride(2) == 1 && bc_alike ? b_in : b_in.contiguous();
  const at::Tensor c = c_in.stride(2) == 1 && bc_alike ? c_in : c_in.contiguous();
  const int64_t total = x.size(0), heads = x.size(1), p = x.size(2), groups = b.size(1), n = b.size(2);
  TORCH_CHECK(heads % groups == 0 && states.heads == heads && states.p == p && states.n == n,
              "state pool, x and B/C shapes disagree");
  TORCH_CHECK(dt.size(0) == total && dt.size(1) == heads && b.size(0) == total, "rows of x, dt, B and C differ");
  const int64_t segs = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> starts(segs + 1, 0);
  for (int64_t i = 0; i < segs; ++i) starts[i + 1] = starts[i] + lengths[i];
  TORCH_CHECK(starts[segs] == total, "segment lengths do not add up to the rows");
  // the discretized step and its decay at every (position, head)
  const at::Tensor a32 = a.to(at::kFloat).contiguous(), d32 = d.to(at::kFloat).contiguous();
  at::Tensor step = at::softplus(dt.to(at::kFloat) + dt_bias.to(at::kFloat));
  if (dt_min > 0.0 || std::isfinite(dt_max)) step = step.clamp(dt_min, dt_max);
  step = step.contiguous();
  const at::Tensor decay = at::exp(step * a32).contiguous();
  std::vector<int64_t> slot_of(slots.begin(), slots.end());
  at::Tensor y = at::empty({total, heads, p}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "ssd_prefill", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      ssd_prefill_scan<scalar_t>(x, b, c, states, starts, slot_of, step.data_ptr<float>(), decay.data_ptr<float>(),
                                 a32.data_ptr<float>(), d32.data_ptr<float>(), y.data_ptr<float>());
    } else {
      TORCH_CHECK(false, "float64 is not a model dtype");
    }
  });
  return y;
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) {
  m.impl("mamba_decode", hyssm_cpu::mamba_decode);
  m.impl("conv_prefill", hyssm_cpu::conv_prefill);
  m.impl("ssd_prefill", hyssm_cpu::ssd_prefill);
}
