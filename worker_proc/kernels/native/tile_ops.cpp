// The matrix product out[M, N] = x[M, K] @ w[N, K]^T (+ bias) of any row count, read from a copy of the weight
// laid out for it (`tile_weight`; worker_proc.linear.kernels `tiled`, a storage the execution plan makes where
// its timings choose the method). Rules that hold:
// - the copy holds the weight's rows in blocks of kTileRows output rows: [ceil(N / kTileRows)][K / P][kTileRows][P],
//   P consecutive input columns of one output row side by side (P = 2 for bfloat16 where the CPU multiplies
//   bfloat16 pairs, AVX512-BF16; 1 otherwise), rows past N zero. A block is one contiguous run of memory,
//   and one vector of it holds one input column (pair) of kTileRows outputs, so an input row's element (pair)
//   is broadcast and multiplied into kTileRows sums at once: no sum is reduced across lanes at the end;
// - the blocks are traversed as every tiled product's are (tiled.h `over_tiles`), kTileGroup blocks side by
//   side in one pass;
// - products accumulate in float32 (bfloat16 pairs: exact products, AVX512-BF16's pair sums), each output
//   in the order of its input columns (in up to four interleaved partial sums where few rows leave the
//   arithmetic waiting on one chain: `unroll`), and the result is rounded once to the input's dtype.
#include <torch/library.h>

#include "cpu_common.h"
#include "layout.h"
#include "tiled.h"

namespace hyssm_cpu {
namespace {


template <typename T>
constexpr int64_t pair_width() {
#if defined(__AVX512BF16__)
  return std::is_same<T, c10::BFloat16>::value ? 2 : 1;
#else
  return 1;
#endif
}

// Stores R x V vectors of sums (output columns n0 + v * kTileRows ...) into out rows of stride n.
template <typename O, int R, int V>
inline void store_sums(const vf16 (&sums)[R][V], const float* bias, O* out, int64_t n, int64_t n0) {
  for (int v = 0; v < V; ++v) {
    const int64_t c0 = n0 + v * kTileRows, count = std::min<int64_t>(kTileRows, n - c0);
    if (count <= 0) continue;
    for (int r = 0; r < R; ++r) {
      float lanes[kTileRows];
      store16(lanes, sums[r][v]);
      for (int64_t l = 0; l < count; ++l) out[r * n + c0 + l] = from_f<O>(lanes[l] + (bias ? bias[c0 + l] : 0.0f));
    }
  }
}

// One pass of R input rows (row stride k) over V blocks starting at `tile` (block stride k * kTileRows).
template <typename T, typename O, int R, int V>
inline void dense_pass(const T* x, int64_t k, const T* tile, const float* bias, O* out, int64_t n, int64_t n0) {
  constexpr int U = unroll<R>();
  const int64_t stride = k * kTileRows;
  vf16 acc[U][R][V];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[u][r][v] = vf16{};
  int64_t j = 0;
  for (; j + U <= k; j += U)
    for (int u = 0; u < U; ++u) {
      vf16 wv[V];
      for (int v = 0; v < V; ++v) wv[v] = load16(tile + v * stride + (j + u) * kTileRows);
      for (int r = 0; r < R; ++r) {
        const vf16 xb = splat(to_f(x[r * k + j + u]));
        for (int v = 0; v < V; ++v) acc[u][r][v] = xb * wv[v] + acc[u][r][v];
      }
    }
  for (; j < k; ++j)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v)
        acc[0][r][v] = splat(to_f(x[r * k + j])) * load16(tile + v * stride + j * kTileRows) + acc[0][r][v];
  vf16 sums[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      sums[r][v] = acc[0][r][v];
      for (int u = 1; u < U; ++u) sums[r][v] += acc[u][r][v];
    }
  store_sums<O, R, V>(sums, bias, out, n, n0);
}

#if defined(__AVX512BF16__)
// `dense_pass` for bfloat16 rows over a block of bfloat16 pairs (k even): each instruction multiplies one pair of
// every output's columns by the row's pair and adds both products to the output's float32 sum.
template <int R, int V>
inline void pass_pairs(const c10::BFloat16* x, int64_t k, const c10::BFloat16* tile, const float* bias,
                       c10::BFloat16* out, int64_t n, int64_t n0) {
  constexpr int U = unroll<R>();
  const int64_t stride = k * kTileRows, pairs = k / 2;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  __m512 acc[U][R][V];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[u][r][v] = _mm512_setzero_ps();
  auto step = [&](int u, int64_t p) {
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(tile + v * stride + p * 2 * kTileRows);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[r * pairs + p]);
      for (int v = 0; v < V; ++v) acc[u][r][v] = _mm512_dpbf16_ps(acc[u][r][v], xb, wv[v]);
    }
  };
  int64_t p = 0;
  for (; p + U <= pairs; p += U)
    for (int u = 0; u < U; ++u) step(u, p + u);
  for (; p < pairs; ++p) step(0, p);
  vf16 sums[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      __m512 s = acc[0][r][v];
      for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[u][r][v]);
      sums[r][v] = (vf16)s;
    }
  store_sums<c10::BFloat16, R, V>(sums, bias, out, n, n0);
}
#endif

// The dense format of `over_tiles` (tiled.h): kTileGroup blocks a pass, bfloat16 pairs where the CPU
// multiplies them.
template <typename T>
struct DenseTiles {
  const T* x;
  int64_t k;
  const T* tiled;
  const float* bias;
  T* out;
  int64_t n;

  template <int R>
  static constexpr int blocks_per_pass() { return kTileGroup; }

  template <int R, int V>
  void pass(int64_t row, int64_t b) const {
    const T* rows = x + row * k;
    const T* tile = tiled + b * k * kTileRows;
#if defined(__AVX512BF16__)
    if constexpr (pair_width<T>() == 2) {
      pass_pairs<R, V>(rows, k, tile, bias, out + row * n, n, b * kTileRows);
      return;
    }
#endif
    dense_pass<T, T, R, V>(rows, k, tile, bias, out + row * n, n, b * kTileRows);
  }
};

// Every input row over every block (`over_tiles`).
template <typename T>
void product(const at::Tensor& x, const at::Tensor& tiled, const float* bias, at::Tensor& out) {
  const DenseTiles<T> format{x.data_ptr<T>(), x.size(1), tiled.data_ptr<T>(), bias, out.data_ptr<T>(), out.size(1)};
  over_tiles(format, x.size(0), tiled.size(0));
}

template <typename T>
void tile_into(const T* w, int64_t n, int64_t k, T* tiled) {
  constexpr int64_t P = pair_width<T>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      T* block = tiled + (row / kTileRows) * k * kTileRows + (row % kTileRows) * P;
      for (int64_t j = 0; j < k; ++j) block[(j / P) * kTileRows * P + j % P] = w[row * k + j];
    }
  });
}

}  // namespace

// The weight [N, K] laid out for `tiled_product` (see the file's rules), written into `out` where given (a
// contiguous buffer of the layout's element count and the weight's dtype, which the caller placed: on huge
// pages, for a copy streamed every step) and returned as a view of it.
at::Tensor tile_weight(const at::Tensor& weight, const c10::optional<at::Tensor>& out) {
  TORCH_CHECK(weight.dim() == 2, "tile_weight: a [N, K] weight expected");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kTileRows - 1) / kTileRows;
  const bool into = out.has_value() && out->defined();
  if (into) {
    TORCH_CHECK(out->is_contiguous() && out->scalar_type() == w.scalar_type() && out->numel() == blocks * k * kTileRows,
                "tile_weight: out must be a contiguous buffer of ", blocks * k * kTileRows, " elements of the weight's dtype");
  }
  const auto layout = [&](std::vector<int64_t> shape) {
    return into ? out->view(shape).zero_() : at::zeros(shape, w.options());
  };
  at::Tensor tiled;
  AT_DISPATCH_SWITCH(w.scalar_type(), "hyssm_tile_weight",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      tiled = layout({blocks, k, kTileRows});
      tile_into(w.data_ptr<float>(), n, k, tiled.data_ptr<float>());
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      constexpr int64_t P = pair_width<c10::BFloat16>();
      TORCH_CHECK(k % P == 0, "tile_weight: a bfloat16 weight's input width must be a multiple of ", P);
      tiled = layout({blocks, k / P, kTileRows, P});
      tile_into(w.data_ptr<c10::BFloat16>(), n, k, tiled.data_ptr<c10::BFloat16>());
    }));
  return tiled;
}

// x [M, K] @ weight.T (+ bias) from the weight's `tile_weight` copy; n: the weight's N.
at::Tensor tiled_product(const at::Tensor& x_in, const at::Tensor& tiled, int64_t n,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2, "tiled_product: x [M, K] expected");
  TORCH_CHECK(tiled.scalar_type() == x_in.scalar_type() && tiled.is_contiguous(),
              "tiled_product: x and the tiled weight must share a dtype");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), blocks = tiled.size(0);
  TORCH_CHECK(tiled.numel() == blocks * k * kTileRows && blocks == (n + kTileRows - 1) / kTileRows,
              "tiled_product: the tiled weight is not a [", n, ", ", k, "] weight's");
  const bool pairs = tiled.dim() == 4 && tiled.size(3) == 2;
  TORCH_CHECK(pairs == (x.scalar_type() == at::kBFloat16 && pair_width<c10::BFloat16>() == 2),
              "tiled_product: the tiled weight was laid out for another CPU");
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  const float* bias_ptr = bf.defined() ? bf.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({m, n}, x.options());
  AT_DISPATCH_SWITCH(x.scalar_type(), "hyssm_tiled_product",
    AT_DISPATCH_CASE(at::kFloat, [&] { product<float>(x, tiled, bias_ptr, out); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { product<c10::BFloat16>(x, tiled, bias_ptr, out); }));
  return out;
}

}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) {
  m.impl("tile_weight", hyssm_cpu::tile_weight);
  m.impl("tiled_product", hyssm_cpu::tiled_product);
}
