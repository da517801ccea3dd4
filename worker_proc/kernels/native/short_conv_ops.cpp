// LFM2's gated short convolution for one token per state slot, in one pass: y = C * conv(B * x) over the rows
// of bcx = [B | C | x] (in_proj's output, the model dtype, unit-stride rows of any stride), each row's conv
// window (conv_pool[slot], [width, K-1] in the model dtype) advanced by its B * x. Roundings as the composed
// torch step rounds in the model dtype: B * x rounded (it is what the window keeps), the conv's sum and bias
// rounded once, the product with C rounded (the sum itself runs in float32, not product by product).
#include <torch/library.h>

#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

constexpr int64_t kChannelBlock = 256;  // channels of one task
constexpr int64_t kInlineTasks = 8;     // fewer tasks than this run on the calling thread

template <typename T>
at::Tensor short_conv_decode_impl(const at::Tensor& bcx, at::Tensor& conv_pool, const at::Tensor& slots,
                                  const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const int64_t rows = bcx.size(0), width = bcx.size(1) / 3, k = weight.size(1), rs = bcx.stride(0);
  at::Tensor out = at::empty({rows, width}, bcx.options().memory_format(at::MemoryFormat::Contiguous));
  const T* in_p = bcx.data_ptr<T>();
  T* pool_p = conv_pool.data_ptr<T>();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const T* w_p = weight.data_ptr<T>();
  const T* b_p = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* o_p = out.data_ptr<T>();
  const int64_t blocks = (width + kChannelBlock - 1) / kChannelBlock;
  at::parallel_for(0, rows * blocks, kInlineTasks, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / blocks, lo = (task % blocks) * kChannelBlock, hi = std::min(width, lo + kChannelBlock);
      const T* b_row = in_p + r * rs;
      const T* c_row = b_row + width;
      const T* x_row = b_row + 2 * width;
      T* window = pool_p + slot_p[r] * width * (k - 1);
      T* o_row = o_p + r * width;
      for (int64_t c = lo; c < hi; ++c) {
        const T bx = from_f<T>(to_f(b_row[c]) * to_f(x_row[c]));
        T* wc = window + c * (k - 1);
        const T* taps = w_p + c * k;
        float acc = to_f(bx) * to_f(taps[k - 1]);
        for (int64_t j = 0; j < k - 1; ++j) acc += to_f(wc[j]) * to_f(taps[j]);
        if (b_p != nullptr) acc += to_f(b_p[c]);
        for (int64_t j = 0; j + 1 < k - 1; ++j) wc[j] = wc[j + 1];
        if (k > 1) wc[k - 2] = bx;
        o_row[c] = from_f<T>(to_f(c_row[c]) * round_to<T>(acc));
      }
    }
  });
  return out;
}

at::Tensor short_conv_decode(const at::Tensor& bcx, at::Tensor conv_pool, const at::Tensor& slots,
                             const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_rows(bcx, "B|C|x");
  TORCH_CHECK(bcx.size(1) % 3 == 0, "short_conv_decode: [rows, 3 * width] expected");
  const int64_t width = bcx.size(1) / 3;
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == width && weight.is_contiguous(),
              "short_conv_decode: the conv weight must be a contiguous [width, K]");
  TORCH_CHECK(conv_pool.is_contiguous() && conv_pool.dim() == 3 && conv_pool.size(1) == width &&
                  conv_pool.size(2) == weight.size(1) - 1,
              "short_conv_decode: the conv pool must be a contiguous [S, width, K - 1]");
  TORCH_CHECK(bcx.scalar_type() == conv_pool.scalar_type() && bcx.scalar_type() == weight.scalar_type() &&
                  (!bias.has_value() || (bias->scalar_type() == bcx.scalar_type() && bias->is_contiguous() &&
                                         bias->numel() == width)),
              "short_conv_decode: B|C|x, the conv pool, weight and bias must share one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == bcx.size(0),
              "short_conv_decode: one int64 slot per row expected");
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bcx.scalar_type(), "short_conv_decode", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      out = short_conv_decode_impl<scalar_t>(bcx, conv_pool, slots, weight, bias);
    } else {
      TORCH_CHECK(false, "float64 is not a model dtype");
    }
  });
  return out;
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) { m.impl("short_conv_decode", hyssm_cpu::short_conv_decode); }
