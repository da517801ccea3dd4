// The matrix product of few input rows (a decode step's): out[M, N] = x[M, K] @ w[N, K]^T (+ bias),
// read from the module's own [out, in] weight, float32 or bfloat16, in two orders the execution plan
// times against the library products for each weight shape and row bucket, binding whichever is faster
// on the machine (worker_proc.linear.methods `gemv` and `gemv_seq`). Rules that hold:
// - every weight row is read once per group of up to kPassRows input rows, and the threads split the weight's
//   rows into contiguous ranges (a step is bound by reading the weight);
// - `gemv` reads four weight rows side by side and asks for the rows PREFETCH_ROWS ahead; `gemv_seq`
//   reads one weight row after another front to back with no software prefetch, so that each thread is
//   one sequential stream for the hardware prefetcher. Which reads faster depends on the machine's
//   memory system, not on the arithmetic;
// - the input rows are converted to float32 once per call (bfloat16 rows against a bfloat16 weight stay
//   bfloat16 where the CPU multiplies bfloat16 pairs into float32: AVX512-BF16, exact products, and the
//   weight is read without widening each element), products accumulate in float32, and the result is
//   rounded once to the input's dtype (F.linear's arithmetic, in another summation order);
// - `gemv_int8` reads an int8 weight in `gemv_seq`'s order, widened to float32 in registers, each finished
//   dot product times its row's scale; `expert_product` runs these products over the experts that routed
//   rows chose (row kernels: gemv_rows.h).
#include <torch/library.h>

#include "gemv_rows.h"

namespace hyssm_cpu {
namespace {

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
        for (int64_t r = 0; r < m; r += kPassRows)
          gemv_group(sequential, xf.data_ptr<float>() + r * k, std::min(kPassRows, m - r), k, w, nullptr, bias_ptr, o + r * n, n,
                     b0 * WEIGHT_ROWS, std::min(n, b1 * WEIGHT_ROWS));
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      const c10::BFloat16* w = weight.data_ptr<c10::BFloat16>();
      c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
      at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
        for (int64_t r = 0; r < m; r += kPassRows) {
          const int64_t take = std::min(kPassRows, m - r), lo = b0 * WEIGHT_ROWS, hi = std::min(n, b1 * WEIGHT_ROWS);
#if defined(__AVX512BF16__)
          if (pairs) {
            gemv_group(sequential, xf.data_ptr<c10::BFloat16>() + r * k, take, k, w, nullptr, bias_ptr, o + r * n, n, lo,
                       hi);
            continue;
          }
#endif
          gemv_group(sequential, xf.data_ptr<float>() + r * k, take, k, w, nullptr, bias_ptr, o + r * n, n, lo, hi);
        }
      });
    }));
  return out;
}

// x @ (data * scale).T (+ bias) for an int8 weight `data` [N, K] with a float32 scale per row, x float32 or
// bfloat16 (converted to float32 once), read in `gemv_seq`'s order; the result in x's dtype.
at::Tensor int8_product(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && data.dim() == 2 && x.size(1) == data.size(1) && data.scalar_type() == at::kChar &&
                  data.is_contiguous(),
              "gemv_int8: x [M, K] and a contiguous int8 weight [N, K] expected");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == data.size(0),
              "gemv_int8: one float32 scale per weight row expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gemv_int8: x must be float32 or bfloat16");
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float *bias_ptr = bf.defined() ? bf.data_ptr<float>() : nullptr, *sc = scale.data_ptr<float>();
  const int8_t* w = data.data_ptr<int8_t>();
  const int64_t blocks = (n + WEIGHT_ROWS - 1) / WEIGHT_ROWS;
  auto run = [&](auto* o) {
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t r = 0; r < m; r += kPassRows)
        gemv_group(true, xf.data_ptr<float>() + r * k, std::min(kPassRows, m - r), k, w, sc, bias_ptr, o + r * n, n,
                   b0 * WEIGHT_ROWS, std::min(n, b1 * WEIGHT_ROWS));
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(out.data_ptr<float>());
  } else {
    run(out.data_ptr<c10::BFloat16>());
  }
  return out;
}

// The products of routed rows with the experts they chose: out[c] = rows[c] @ stack[idx[c]]^T for every
// choice c of idx [T, k] (c = t * k + j), where rows[c] is x[t] (x [T, K]) or, `per_choice`, x[c]
// (x [T * k, K]). The stack is [E, N, K] in x's dtype, or int8 with `scale` [E, N] (a quantized stack's
// per-row scales). The choices are grouped by expert in a stable order (the grouped torch path's order);
// each chosen expert's matrix is read once, as `few_row_product` reads a weight, for all its rows, and
// the threads split every chosen matrix's rows.
at::Tensor expert_product(const at::Tensor& x, const at::Tensor& stack, const c10::optional<at::Tensor>& scale,
                          const at::Tensor& idx, bool per_choice, bool sequential) {
  TORCH_CHECK(x.dim() == 2 && stack.dim() == 3 && idx.dim() == 2 && x.size(1) == stack.size(2),
              "expert_product: x [T, K], stack [E, N, K] and idx [T, k] expected");
  TORCH_CHECK(stack.stride(2) == 1 && stack.stride(1) == stack.size(2), "expert_product: each expert must be contiguous");
  const bool quantized = stack.scalar_type() == at::kChar;
  TORCH_CHECK(quantized || x.scalar_type() == stack.scalar_type(), "expert_product: x and the stack must share a dtype");
  TORCH_CHECK(!quantized || (scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                             scale->numel() == stack.size(0) * stack.size(1)),
              "expert_product: an int8 stack needs float32 scales [E, N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "expert_product: x must be float32 or bfloat16");
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
  const bool pairs = !quantized && x.scalar_type() == at::kBFloat16;
#else
  const bool pairs = false;
#endif
  const int64_t per_row = per_choice ? 1 : idx.size(1);
  at::Tensor src = at::empty({choices}, ic.options()), dest = at::empty({choices}, ic.options());
  for (int64_t i = 0; i < choices; ++i) {
    src.data_ptr<int64_t>()[i] = order[i] / per_row;
    dest.data_ptr<int64_t>()[i] = order[i];
  }
  const at::Tensor xs = (pairs ? x : x.to(at::kFloat)).index_select(0, src).contiguous();  // rows in expert order
  at::Tensor sorted = at::empty({choices, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* scales = quantized ? scale->data_ptr<float>() : nullptr;
  std::vector<int64_t> used;  // tasks: (chosen expert, block of `span` weight rows)
  for (int64_t e = 0; e < experts; ++e)
    if (count[e + 1] > count[e]) used.push_back(e);
  const int64_t span = WEIGHT_ROWS * 16, blocks = (n + span - 1) / span;
  const int64_t tasks = static_cast<int64_t>(used.size()) * blocks;
  auto run = [&](const auto* w0, const auto* xp, auto* op) {
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t e = used[t / blocks], lo = (t % blocks) * span, hi = std::min(n, lo + span);
        const float* sc = scales ? scales + e * n : nullptr;
        for (int64_t r = count[e]; r < count[e + 1]; r += kPassRows)
          gemv_group(sequential, xp + r * k, std::min(kPassRows, count[e + 1] - r), k, w0 + e * stack.stride(0), sc,
                     nullptr, op + r * n, n, lo, hi);
      }
    });
  };
  const float* xf = pairs ? nullptr : xs.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    if (quantized) run(stack.data_ptr<int8_t>(), xf, sorted.data_ptr<float>());
    else run(stack.data_ptr<float>(), xf, sorted.data_ptr<float>());
  } else if (quantized) {
    run(stack.data_ptr<int8_t>(), xf, sorted.data_ptr<c10::BFloat16>());
  } else if (pairs) {
#if defined(__AVX512BF16__)
    run(stack.data_ptr<c10::BFloat16>(), xs.data_ptr<c10::BFloat16>(), sorted.data_ptr<c10::BFloat16>());
#endif
  } else {
    run(stack.data_ptr<c10::BFloat16>(), xf, sorted.data_ptr<c10::BFloat16>());
  }
  return at::empty_like(sorted).index_copy_(0, dest, sorted);
}

}  // namespace

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return few_row_product(x, weight, bias, false);
}

at::Tensor gemv_seq(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return few_row_product(x, weight, bias, true);
}

}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) {
  m.impl("expert_product", hyssm_cpu::expert_product);
  m.impl("gemv_int8", hyssm_cpu::int8_product);
  m.impl("gemv", hyssm_cpu::gemv);
  m.impl("gemv_seq", hyssm_cpu::gemv_seq);
}
