// The matrix product of few input rows (a decode step's): out[M, N] = x[M, K] @ w[N, K]^T (+ bias),
// read from the module's own [out, in] weight, float32 or bfloat16, in two orders the execution plan
// times against the library products for each weight shape and row bucket, binding whichever is faster
// on the machine (worker_proc.model.gemm `gemv` and `gemv_seq`). Rules that hold:
// - every weight row is read once per group of up to ROWS input rows, and the threads split the weight's
//   rows into contiguous ranges (a step is bound by reading the weight);
// - `gemv` reads four weight rows side by side and asks for the rows PREFETCH_ROWS ahead; `gemv_seq`
//   reads one weight row after another front to back with no software prefetch, so that each thread is
//   one sequential stream for the hardware prefetcher. Which reads faster depends on the machine's
//   memory system, not on the arithmetic;
// - the input rows are converted to float32 once per call (bfloat16 rows against a bfloat16 weight stay
//   bfloat16 where the CPU multiplies bfloat16 pairs into float32: AVX512-BF16, exact products, and the
//   weight is read without widening each element), products accumulate in float32, and the result is
//   rounded once to the input's dtype (F.linear's arithmetic, in another summation order).
#include <torch/library.h>

#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

constexpr int64_t ROWS = 8;        // input rows sharing one pass over the weight
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

template <typename W, typename O, int R, typename X>
void seq_range(const X* x, int64_t k, const W* w, const float* bias, O* out, int64_t n, int64_t begin, int64_t end) {
  float acc[R];
  for (int64_t row = begin; row < end; ++row) {
    row_dot<R>(x, k, w + row * k, acc);
    for (int r = 0; r < R; ++r) out[r * n + row] = from_f<O>(acc[r] + (bias ? bias[row] : 0.0f));
  }
}

template <typename W, typename O, int R, typename X>
void rows_range(const X* x, int64_t k, const W* w, const float* bias, O* out, int64_t n, int64_t begin,
                int64_t end) {
  constexpr int WR = R <= 4 ? WEIGHT_ROWS : WEIGHT_ROWS / 2;  // R * WR accumulators stay in registers
  float acc[ROWS][WEIGHT_ROWS];
  for (int64_t row = begin; row < end;) {
    const int64_t take = std::min<int64_t>(WR, end - row);
    const W* ws[WEIGHT_ROWS];
    for (int64_t i = 0; i < take; ++i) ws[i] = w + (row + i) * k;
    if (take == WR) {
      dot_rows<R, WR>(x, k, ws, acc);
    } else {
      for (int64_t i = 0; i < take; ++i) {
        float one[ROWS][WEIGHT_ROWS];
        dot_rows<R, 1>(x, k, ws + i, one);
        for (int r = 0; r < R; ++r) acc[r][i] = one[r][0];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < take; ++i)
        out[r * n + row + i] = from_f<O>(acc[r][i] + (bias ? bias[row + i] : 0.0f));
    row += take;
  }
}

template <typename W, typename O, int R, typename X>
void range_in_order(bool sequential, const X* x, int64_t k, const W* w, const float* bias, O* out, int64_t n,
                    int64_t begin, int64_t end) {
  if (sequential) return seq_range<W, O, R>(x, k, w, bias, out, n, begin, end);
  rows_range<W, O, R>(x, k, w, bias, out, n, begin, end);
}

template <typename W, typename O, typename X>
void gemv_group(bool sequential, const X* x, int64_t rows, int64_t k, const W* w, const float* bias, O* out,
                int64_t n, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: return range_in_order<W, O, 1>(sequential, x, k, w, bias, out, n, begin, end);
    case 2: return range_in_order<W, O, 2>(sequential, x, k, w, bias, out, n, begin, end);
    case 3: return range_in_order<W, O, 3>(sequential, x, k, w, bias, out, n, begin, end);
    case 4: return range_in_order<W, O, 4>(sequential, x, k, w, bias, out, n, begin, end);
    case 5: return range_in_order<W, O, 5>(sequential, x, k, w, bias, out, n, begin, end);
    case 6: return range_in_order<W, O, 6>(sequential, x, k, w, bias, out, n, begin, end);
    case 7: return range_in_order<W, O, 7>(sequential, x, k, w, bias, out, n, begin, end);
    default: return range_in_order<W, O, 8>(sequential, x, k, w, bias, out, n, begin, end);
  }
}

// x @ weight.T (+ bias) in the order `sequential` names (see the file's rules).
at::Tensor few_row_product(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           bool sequential) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "gemv: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(weight.is_contiguous(), "gemv: the weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "gemv: x and weight must share a dtype");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
#if defined(__AVX512BF16__)
  const bool pairs = x.scalar_type() == at::kBFloat16;  // bfloat16 rows go to the pair products as they are
#else
  const bool pairs = false;
#endif
  const at::Tensor xf = pairs ? x.contiguous() : x.to(at::kFloat).contiguous();
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* bias_ptr = bf.defined() ? bf.data_ptr<float>() : nullptr;
  // each thread takes a contiguous range of weight rows (a multiple of WEIGHT_ROWS) for every row group
  const int64_t blocks = (n + WEIGHT_ROWS - 1) / WEIGHT_ROWS;
  AT_DISPATCH_SWITCH(weight.scalar_type(), "hyssm_gemv",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const float* w = weight.data_ptr<float>();
      float* o = out.data_ptr<float>();
      at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
        for (int64_t r = 0; r < m; r += ROWS)
          gemv_group(sequential, xf.data_ptr<float>() + r * k, std::min(ROWS, m - r), k, w, bias_ptr, o + r * n, n,
                     b0 * WEIGHT_ROWS, std::min(n, b1 * WEIGHT_ROWS));
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      const c10::BFloat16* w = weight.data_ptr<c10::BFloat16>();
      c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
      at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
        for (int64_t r = 0; r < m; r += ROWS) {
          const int64_t take = std::min(ROWS, m - r), lo = b0 * WEIGHT_ROWS, hi = std::min(n, b1 * WEIGHT_ROWS);
#if defined(__AVX512BF16__)
          if (pairs) {
            gemv_group(sequential, xf.data_ptr<c10::BFloat16>() + r * k, take, k, w, bias_ptr, o + r * n, n, lo, hi);
            continue;
          }
#endif
          gemv_group(sequential, xf.data_ptr<float>() + r * k, take, k, w, bias_ptr, o + r * n, n, lo, hi);
        }
      });
    }));
  return out;
}

// The products of routed rows with the experts they chose: out[c] = rows[c] @ stack[idx[c]]^T for every
// choice c of idx [T, k] (c = t * k + j), where rows[c] is x[t] (x [T, K]) or, `per_choice`, x[c]
// (x [T * k, K]). The choices are grouped by expert in a stable order (the grouped torch path's order);
// each chosen expert's matrix is read once, as `few_row_product` reads a weight, for all its rows, and
// the threads split every chosen matrix's rows.
at::Tensor expert_product(const at::Tensor& x, const at::Tensor& stack, const at::Tensor& idx, bool per_choice,
                          bool sequential) {
  TORCH_CHECK(x.dim() == 2 && stack.dim() == 3 && idx.dim() == 2 && x.size(1) == stack.size(2),
              "expert_product: x [T, K], stack [E, N, K] and idx [T, k] expected");
  TORCH_CHECK(stack.stride(2) == 1 && stack.stride(1) == stack.size(2), "expert_product: each expert must be contiguous");
  TORCH_CHECK(x.scalar_type() == stack.scalar_type(), "expert_product: x and the stack must share a dtype");
  TORCH_CHECK(idx.scalar_type() == at::kLong, "expert_product: idx must be int64");
  const int64_t choices = idx.numel(), k = x.size(1), n = stack.size(1), experts = stack.size(0);
  TORCH_CHECK(x.size(0) == (per_choice ? choices : idx.size(0)), "expert_product: ", x.size(0), " rows for ",
              idx.size(0), " tokens choosing ", idx.size(1), " experts each");
  const at::Tensor ic = idx.contiguous();
  const int64_t* chosen = ic.data_ptr<int64_t>();
  std::vector<int64_t> count(experts + 1, 0), order(choices);
  for (int64_t c = 0; c < choices; ++c) {
    TORCH_CHECK(chosen[c] >= 0 && chosen[c] < experts, "expert_product: expert ", chosen[c], " of ", experts);
    ++count[chosen[c] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) count[e + 1] += count[e];  // count[e]: where expert e's choices start
  {
    std::vector<int64_t> next(count.begin(), count.end() - 1);
    for (int64_t c = 0; c < choices; ++c) order[next[chosen[c]]++] = c;
  }
#if defined(__AVX512BF16__)
  const bool pairs = x.scalar_type() == at::kBFloat16;
#else
  const bool pairs = false;
#endif
  const int64_t per_row = per_choice ? 1 : idx.size(1);
  at::Tensor src = at::empty({choices}, ic.options());
  for (int64_t i = 0; i < choices; ++i) src.data_ptr<int64_t>()[i] = order[i] / per_row;
  const at::Tensor xs = (pairs ? x : x.to(at::kFloat)).index_select(0, src).contiguous();  // rows in expert order
  at::Tensor sorted = at::empty({choices, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  // tasks: (expert, block of WEIGHT_ROWS * 16 weight rows) over the chosen experts
  const int64_t span = WEIGHT_ROWS * 16, blocks = (n + span - 1) / span;
  std::vector<int64_t> used;
  for (int64_t e = 0; e < experts; ++e)
    if (count[e + 1] > count[e]) used.push_back(e);
  const int64_t tasks = static_cast<int64_t>(used.size()) * blocks;
  AT_DISPATCH_SWITCH(stack.scalar_type(), "hyssm_expert_product",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t e = used[t / blocks], lo = (t % blocks) * span, hi = std::min(n, lo + span);
          const float* w = stack.data_ptr<float>() + e * stack.stride(0);
          for (int64_t r = count[e]; r < count[e + 1]; r += ROWS)
            gemv_group(sequential, xs.data_ptr<float>() + r * k, std::min(ROWS, count[e + 1] - r), k, w, nullptr,
                       sorted.data_ptr<float>() + r * n, n, lo, hi);
        }
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t e = used[t / blocks], lo = (t % blocks) * span, hi = std::min(n, lo + span);
          const c10::BFloat16* w = stack.data_ptr<c10::BFloat16>() + e * stack.stride(0);
          c10::BFloat16* o = sorted.data_ptr<c10::BFloat16>();
          for (int64_t r = count[e]; r < count[e + 1]; r += ROWS) {
            const int64_t take = std::min(ROWS, count[e + 1] - r);
#if defined(__AVX512BF16__)
            if (pairs) {
              gemv_group(sequential, xs.data_ptr<c10::BFloat16>() + r * k, take, k, w, nullptr, o + r * n, n, lo, hi);
              continue;
            }
#endif
            gemv_group(sequential, xs.data_ptr<float>() + r * k, take, k, w, nullptr, o + r * n, n, lo, hi);
          }
        }
      });
    }));
  at::Tensor out = at::empty_like(sorted);
  at::Tensor dest = at::empty({choices}, ic.options());
  for (int64_t i = 0; i < choices; ++i) dest.data_ptr<int64_t>()[i] = order[i];
  out.index_copy_(0, dest, sorted);
  return out;
}

}  // namespace

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return few_row_product(x, weight, bias, false);
}

at::Tensor gemv_seq(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return few_row_product(x, weight, bias, true);
}

}  // namespace hyssm_cpu

TORCH_LIBRARY_FRAGMENT(hyssm_cpu, m) {
  m.def("expert_product(Tensor x, Tensor stack, Tensor idx, bool per_choice, bool sequential) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) {
  m.impl("expert_product", hyssm_cpu::expert_product);
  m.impl("gemv", hyssm_cpu::gemv);
  m.impl("gemv_seq", hyssm_cpu::gemv_seq);
}
