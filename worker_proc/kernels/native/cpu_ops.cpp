// Fused CPU kernels of the decode step (worker_proc.kernels.native loads and describes them).
//
// Each op does in one pass over its data what the pure-torch FastOps does in tens of dispatched ops,
// with the same arithmetic: every recurrent quantity in float32, values the pure-torch path rounds to
// the model dtype (the conv outputs, a norm's result) rounded to it here too. Rules that hold:
// - the pools are read and written only at the slots given, which are distinct;
// - the recurrent-state pool is contiguous [S, H, P, N] in its storage (`StatePool`), read into
//   float32 once per call and head and written back once; the conv pool [S, Cd, K-1] is contiguous in
//   the model dtype;
// - row inputs (xBC, dt, z) may be views with any row stride; their last dimension is unit-stride.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

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

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width] with unit-stride rows");
}

// One token through one head's state rows: for each of the head's `p` rows q, state[q] = state[q] * decay +
// (step x[q]) B and out[q] = state[q] . C + d x[q]. Rows go four at a time so that four independent
// dot products share each load of B and C and hide each other's latency.
inline void advance_head(float* st, int64_t p, int64_t n, float decay, float step, const float* x, const float* bt,
                         const float* ct, float d, float* out) {
  int64_t q = 0;
  for (; q + 4 <= p; q += 4) {
    float* s0 = st + q * n;
    float* s1 = s0 + n;
    float* s2 = s1 + n;
    float* s3 = s2 + n;
    const float u0 = step * x[q], u1 = step * x[q + 1], u2 = step * x[q + 2], u3 = step * x[q + 3];
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t j = 0; j < n; ++j) {
      const float bj = bt[j], cj = ct[j];
      const float v0 = s0[j] * decay + u0 * bj, v1 = s1[j] * decay + u1 * bj;
      const float v2 = s2[j] * decay + u2 * bj, v3 = s3[j] * decay + u3 * bj;
      s0[j] = v0;
      s1[j] = v1;
      s2[j] = v2;
      s3[j] = v3;
      a0 += v0 * cj;
      a1 += v1 * cj;
      a2 += v2 * cj;
      a3 += v3 * cj;
    }
    out[q] = a0 + x[q] * d;
    out[q + 1] = a1 + x[q + 1] * d;
    out[q + 2] = a2 + x[q + 2] * d;
    out[q + 3] = a3 + x[q + 3] * d;
  }
  for (; q < p; ++q) {
    float* srow = st + q * n;
    const float u = step * x[q];
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < n; ++j) {
      const float v = srow[j] * decay + u * bt[j];
      srow[j] = v;
      acc += v * ct[j];
    }
    out[q] = acc + x[q] * d;
  }
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

  // 1. conv: out = silu(sum(window * w) + b) rounded to T; the window shifts in the new input
  at::Tensor conv_out = at::empty({rows, cd}, xbc.options().dtype(at::kFloat));
  float* co_p = conv_out.data_ptr<float>();
  at::parallel_for(0, rows * cd, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / cd, c = i % cd;
      T* win = conv_p + (slot_p[r] * cd + c) * (k - 1);
      const T* w = w_p + c * k;
      const T x = xbc_p[r * xbc_rs + c];
      float acc = 0.0f;
      for (int64_t j = 0; j < k - 1; ++j) acc += to_f(win[j]) * to_f(w[j]);
      acc += to_f(x) * to_f(w[k - 1]);
      if (b_p != nullptr) acc += to_f(b_p[c]);
      for (int64_t j = 0; j + 1 < k - 1; ++j) win[j] = win[j + 1];
      if (k > 1) win[k - 2] = x;
      co_p[i] = round_to<T>(silu(acc));
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
      advance_head(st, p, n, decay, step, x, bv, cv, d_p[h], y_p + (r * heads + h) * p);
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

// The depthwise causal conv + SiLU of prefill segments: segment i (`lengths`, `slots`) continues from
// its slot's window of the K-1 inputs before it. x [T, Cd] (any row stride, unit-stride channels),
// weight [Cd, K], bias [Cd] or none, conv_pool [S, Cd, K-1], all in the model dtype. Returns [T, Cd]
// in it: the sum in float32, rounded to the dtype before and after the SiLU (as the torch path's conv
// and activation round); each slot's window ends as the segment's last K-1 inputs.
template <typename T>
at::Tensor conv_prefill_impl(const at::Tensor& x, at::Tensor& conv_pool, const std::vector<int64_t>& lengths,
                             const std::vector<int64_t>& slots, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias) {
  const int64_t total = x.size(0), cd = x.size(1), k = weight.size(1), segs = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> starts(segs + 1, 0);
  for (int64_t i = 0; i < segs; ++i) starts[i + 1] = starts[i] + lengths[i];
  TORCH_CHECK(starts[segs] == total, "segment lengths do not add up to the rows");
  const at::Tensor wt = weight.to(at::kFloat).t().contiguous();  // [K, Cd]
  const at::Tensor b32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::zeros({cd}, wt.options());
  const float *w_p = wt.data_ptr<float>(), *b_p = b32.data_ptr<float>();
  const T* x_p = x.data_ptr<T>();
  T* pool_p = conv_pool.data_ptr<T>();
  const int64_t xs = x.stride(0), block = 256, blocks = (cd + block - 1) / block;
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
        for (int64_t c = 0; c < width; ++c) acc[c] = b_p[c0 + c];
        for (int64_t j = 0; j < k; ++j) {
          const T* in = input(t + j);
          const float* wj = w_p + j * cd + c0;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) acc[c] += wj[c] * to_f(in[c]);
        }
        T* orow = o_p + (start + t) * cd + c0;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) orow[c] = from_f<T>(silu(round_to<T>(acc[c])));
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
                        const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_rows(x, "x");
  TORCH_CHECK(conv_pool.is_contiguous() && conv_pool.size(1) == x.size(1) && conv_pool.size(2) == weight.size(1) - 1,
              "conv pool must be contiguous [S, Cd, K-1]");
  TORCH_CHECK(x.scalar_type() == conv_pool.scalar_type() && weight.size(0) == x.size(1),
              "x and the conv pool must share one dtype; weight [Cd, K]");
  TORCH_CHECK(lengths.size() == slots.size(), "one slot per segment");
  std::vector<int64_t> lens(lengths.begin(), lengths.end()), sl(slots.begin(), slots.end());
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "conv_prefill", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      out = conv_prefill_impl<scalar_t>(x, conv_pool, lens, sl, weight, bias);
    } else {
      TORCH_CHECK(false, "float64 is not a model dtype");
    }
  });
  return out;
}

// The SSD scan of prefill segments token by token: for each segment (`lengths`, `slots`), each head h
// and each row q of its state, state = state * exp(dt a) + (dt x) B and y = state . C + D x at every
// position. x [T, H, P], dt [T, H] raw, b, c [T, G, N] (head h reads group h / (H / G)), in the model
// dtype with a unit-stride last dim; they are read as float32 (widened once, not once per head). Returns
// y [T, H, P] float32; each segment's slot of the float32 pool ends at the state after its last token.
at::Tensor ssd_prefill(const at::Tensor& x_in, const at::Tensor& dt, const at::Tensor& b_in, const at::Tensor& c_in,
                       at::Tensor ssm_pool, const c10::optional<at::Tensor>& ssm_scale, at::IntArrayRef lengths, at::IntArrayRef slots, const at::Tensor& a,
                       const at::Tensor& d, const at::Tensor& dt_bias, double dt_min, double dt_max) {
  TORCH_CHECK(x_in.dim() == 3 && dt.dim() == 2 && b_in.dim() == 3 && c_in.dim() == 3,
              "x [T, H, P], dt [T, H], B/C [T, G, N]");
  TORCH_CHECK(b_in.sizes() == c_in.sizes(), "B and C must have one shape");
  const StatePool states(ssm_pool, ssm_scale);
  TORCH_CHECK(lengths.size() == slots.size(), "one slot per segment");
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), b = b_in.to(at::kFloat).contiguous();
  const at::Tensor c = c_in.to(at::kFloat).contiguous();
  const int64_t total = x.size(0), heads = x.size(1), p = x.size(2), groups = b.size(1), n = b.size(2);
  TORCH_CHECK(heads % groups == 0 && states.heads == heads && states.p == p && states.n == n,
              "state pool, x and B/C shapes disagree");
  TORCH_CHECK(dt.size(0) == total && dt.size(1) == heads && b.size(0) == total, "rows of x, dt, B and C differ");
  const int64_t per_group = heads / groups, segs = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> starts(segs + 1, 0);
  for (int64_t i = 0; i < segs; ++i) starts[i + 1] = starts[i] + lengths[i];
  TORCH_CHECK(starts[segs] == total, "segment lengths do not add up to the rows");
  // the discretized step and its decay at every (position, head)
  const at::Tensor a32 = a.to(at::kFloat), d32 = d.to(at::kFloat).contiguous();
  at::Tensor step = at::softplus(dt.to(at::kFloat) + dt_bias.to(at::kFloat));
  if (dt_min > 0.0 || std::isfinite(dt_max)) step = step.clamp(dt_min, dt_max);
  step = step.contiguous();
  const at::Tensor decay = at::exp(step * a32).contiguous();
  const float *step_p = step.data_ptr<float>(), *decay_p = decay.data_ptr<float>(), *d_p = d32.data_ptr<float>();
  const float *x_p = x.data_ptr<float>(), *b_p = b.data_ptr<float>(), *c_p = c.data_ptr<float>();
  std::vector<int64_t> slot_of(slots.begin(), slots.end());
  at::Tensor y = at::empty({total, heads, p}, x.options());
  float* y_p = y.data_ptr<float>();
  at::parallel_for(0, segs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(states.direct() ? 0 : p * n);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t sg = u / heads, h = u % heads, g = h / per_group;
      float* st = states.load(slot_of[sg], h, buf.data());
      for (int64_t t = starts[sg]; t < starts[sg + 1]; ++t) {
        const int64_t th = t * heads + h;
        advance_head(st, p, n, decay_p[th], step_p[th], x_p + th * p, b_p + (t * groups + g) * n,
                     c_p + (t * groups + g) * n, d_p[h], y_p + th * p);
      }
      states.store(slot_of[sg], h, st);
    }
  });
  return y;
}

// Mamba2's gated RMSNorm per group of channels: norm(y * silu(z)) * w, or with `before_gate`
// norm(y) * w * silu(z); without a weight only y * silu(z). y [rows, I] float32; z [rows, I] in the
// model dtype. Returns float32 [rows, I] (the mixer rounds it to its dtype before out_proj).
template <typename T>
at::Tensor gated_rms_norm_impl(const at::Tensor& y, const at::Tensor& z, const c10::optional<at::Tensor>& weight,
                               int64_t groups, double eps, bool before_gate) {
  const int64_t rows = y.size(0), width = y.size(1), size = width / groups;
  at::Tensor out = at::empty({rows, width}, y.options().dtype(at::kFloat));
  at::Tensor w32;
  if (weight.has_value()) w32 = weight->to(at::kFloat).contiguous();
  const float* w_p = weight.has_value() ? w32.data_ptr<float>() : nullptr;
  const float* y_p = y.data_ptr<float>();
  const T* z_p = z.data_ptr<T>();
  const int64_t y_rs = y.stride(0), z_rs = z.stride(0);
  float* o_p = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(size);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / groups, off = (i % groups) * size;
      const float* yr = y_p + r * y_rs + off;
      const T* zr = z_p + r * z_rs + off;
      float* orow = o_p + r * width + off;
#pragma omp simd
      for (int64_t j = 0; j < size; ++j) gate[j] = silu(to_f(zr[j]));
      if (w_p == nullptr) {
        for (int64_t j = 0; j < size; ++j) orow[j] = yr[j] * gate[j];
        continue;
      }
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < size; ++j) {
        const float h = before_gate ? yr[j] : yr[j] * gate[j];
        orow[j] = h;
        ss += h * h;
      }
      const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(size) + e);
      const float* w = w_p + off;
      for (int64_t j = 0; j < size; ++j) {
        const float v = orow[j] * rstd * w[j];
        orow[j] = before_gate ? v * gate[j] : v;
      }
    }
  });
  return out;
}

at::Tensor gated_rms_norm(const at::Tensor& y, const at::Tensor& z, const c10::optional<at::Tensor>& weight,
                          int64_t groups, double eps, bool before_gate) {
  check_rows(y, "y");
  check_rows(z, "z");
  TORCH_CHECK(y.scalar_type() == at::kFloat, "y must be float32");
  TORCH_CHECK(y.sizes() == z.sizes() && y.size(1) % groups == 0, "y and z must be [rows, groups * size]");
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "gated_rms_norm", [&] {
    out = gated_rms_norm_impl<scalar_t>(y, z, weight, groups, eps, before_gate);
  });
  return out;
}

// The residual-stream RMSNorm with transformers' rounding for each weighting (`RmsWeighting`): x / rms(x)
// rounded to the model dtype, then times the weight and rounded again (kModelDtype); times the weight
// in float32 and rounded once (kFloat32); times (1 + weight) in float32 and rounded once (kUnitOffset).
// x [rows, width] (any row stride); the statistics are float32.
enum RmsWeighting : int64_t { kModelDtype = 0, kFloat32 = 1, kUnitOffset = 2 };

template <typename T>
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t weighting) {
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor out = at::empty({rows, width}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const T* x_p = x.data_ptr<T>();
  const T* w_p = weight.data_ptr<T>();
  T* o_p = out.data_ptr<T>();
  const int64_t rs = x.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x_p + r * rs;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < width; ++j) ss += to_f(xr[j]) * to_f(xr[j]);
      const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(width) + e);
      T* orow = o_p + r * width;
      for (int64_t j = 0; j < width; ++j) {
        const float v = to_f(xr[j]) * rstd;
        const float w = to_f(w_p[j]);
        if (weighting == kModelDtype) {
          orow[j] = from_f<T>(w * round_to<T>(v));
        } else if (weighting == kFloat32) {
          orow[j] = from_f<T>(w * v);
        } else {
          orow[j] = from_f<T>(v * (1.0f + w));
        }
      }
    }
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t weighting) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1),
              "the norm weight must be [width] in x's dtype");
  TORCH_CHECK(weighting >= kModelDtype && weighting <= kUnitOffset, "unknown weighting ", weighting);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    out = rms_norm_impl<scalar_t>(x, weight, eps, weighting);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(hyssm_cpu, m) {
  m.def(
      "mamba_decode(Tensor xbc, Tensor dt, Tensor(a!) conv_pool, Tensor(b!) ssm_pool, Tensor(c!)? ssm_scale, "
      "Tensor slots, "
      "Tensor conv_w, Tensor? conv_b, Tensor a, Tensor d, Tensor dt_bias, Tensor? head_group, float dt_min, "
      "float dt_max, int groups) -> Tensor");
  m.def(
      "conv_prefill(Tensor x, Tensor(a!) conv_pool, int[] lengths, int[] slots, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "ssd_prefill(Tensor x, Tensor dt, Tensor b, Tensor c, Tensor(a!) ssm_pool, Tensor(b!)? ssm_scale, "
      "int[] lengths, int[] slots, "
      "Tensor a, Tensor d, Tensor dt_bias, float dt_min, float dt_max) -> Tensor");
  m.def("gated_rms_norm(Tensor y, Tensor z, Tensor? weight, int groups, float eps, bool before_gate) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int weighting) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) {
  m.impl("mamba_decode", mamba_decode);
  m.impl("conv_prefill", conv_prefill);
  m.impl("ssd_prefill", ssd_prefill);
  m.impl("gated_rms_norm", gated_rms_norm);
  m.impl("rms_norm", rms_norm);
}
