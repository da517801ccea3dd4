// The w8a8 product of few rows (worker_proc.quant.weight `w8a8`'s arithmetic, to the bit): the rows of x
// quantized to int8 with a float32 scale each (xq, xs, as `quantize_rows` does), an int8 weight [N, K] with a
// float32 scale per row; out[r, n] = float(sum_k xq[r, k] * w[n, k]) * (xs[r] * scale[n]), in float32. Rules
// that hold:
// - the sums are exact in int32 (|sum| <= K * 127 * 127), so the result does not depend on the summation
//   order, the thread count or the instructions: AVX512-VNNI multiplies 64 byte pairs per instruction
//   (xq + 128 as unsigned bytes, the weight's 128 * row sum taken off after), other CPUs run the same sums
//   in plain integer arithmetic;
// - `gemv_w8a8`: the threads split the weight's rows into contiguous ranges, each row read once for up to
//   kPassRows rows of x, front to back (one stream per thread, as `gemv_seq`);
// - `tiled_w8a8` reads a copy of the weight laid out in blocks of kTileRows output rows,
//   [ceil(N / kTileRows)][K / 4][kTileRows][4] (four consecutive input columns of one output row side by side, rows
//   past N zero), with each output row's sum of values (int32, [ceil(N / kTileRows) * kTileRows]): one vector holds
//   four input columns of kTileRows outputs, so a row of x's four bytes are broadcast and multiplied into kTileRows
//   sums at once and no sum is reduced across lanes; the blocks are traversed as every tiled product's are
//   (tiled.h `over_tiles`), kTileGroup blocks side by side in one pass.
#include <torch/library.h>

#include "cpu_common.h"
#include "layout.h"
#include "int8_rows.h"
#include "tiled.h"

namespace hyssm_cpu {
namespace {


// acc[r] = sum_j xq[r * k + j] * w[j] for R rows, exactly.
template <int R>
inline void int8_dots(const int8_t* xq, int64_t k, const int8_t* w, int32_t* acc) {
  int64_t j = 0;
  for (int r = 0; r < R; ++r) acc[r] = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i sums[R];
  for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
  __m512i wsum = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), ones = _mm512_set1_epi8(1);
  for (; j + 64 <= k; j += 64) {
    const __m512i wv = _mm512_loadu_si512(w + j);
    wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
    for (int r = 0; r < R; ++r) {
      const __m512i xu = _mm512_xor_si512(_mm512_loadu_si512(xq + r * k + j), flip);  // xq + 128, unsigned
      sums[r] = _mm512_dpbusd_epi32(sums[r], xu, wv);
    }
  }
  const int32_t row_sum = _mm512_reduce_add_epi32(wsum);
  for (int r = 0; r < R; ++r) acc[r] = _mm512_reduce_add_epi32(sums[r]) - 128 * row_sum;
#endif
  for (; j < k; ++j)
    for (int r = 0; r < R; ++r) acc[r] += static_cast<int32_t>(xq[r * k + j]) * static_cast<int32_t>(w[j]);
}

template <int R>
void rows_of(const int8_t* xq, const float* xs, int64_t k, const int8_t* w, const float* scale, float* out,
             int64_t n, int64_t begin, int64_t end) {
  int32_t acc[R];
  for (int64_t row = begin; row < end; ++row) {
    int8_dots<R>(xq, k, w + row * k, acc);
    for (int r = 0; r < R; ++r) out[r * n + row] = static_cast<float>(acc[r]) * (xs[r] * scale[row]);
  }
}

void group(const int8_t* xq, const float* xs, int64_t rows, int64_t k, const int8_t* w, const float* scale,
           float* out, int64_t n, int64_t begin, int64_t end) {
  with_rows<kPassRows>(rows, [&](auto r) { rows_of<decltype(r)::value>(xq, xs, k, w, scale, out, n, begin, end); });
}


#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The lanes of a block's first `count` outputs (all of them unless the weight ends inside the block).
inline __mmask16 live_lanes(int64_t count) {
  return count >= kTileRows ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
}
#endif

// One pass of R rows of x (as bytes xb: xq + 128 where the CPU multiplies unsigned by signed bytes, else xq;
// row stride k) over V blocks starting at `tile` (block stride k * kTileRows).
template <int R, int V>
inline void tiled_pass(const int8_t* xb, const float* xs, int64_t k, const int8_t* tile, const int32_t* wsum,
                       const float* scale, float* out, int64_t n, int64_t n0) {
  const int64_t stride = k * kTileRows, quads = k / kInt8TileColumns;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  constexpr int U = unroll<R>();
  const int32_t* xp = reinterpret_cast<const int32_t*>(xb);
  __m512i acc[U][R][V];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[u][r][v] = _mm512_setzero_si512();
  auto step = [&](int u, int64_t p) {
    __m512i wv[V];
    for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_si512(tile + v * stride + p * kInt8TileColumns * kTileRows);
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(xp[r * quads + p]);
      for (int v = 0; v < V; ++v) acc[u][r][v] = _mm512_dpbusd_epi32(acc[u][r][v], xv, wv[v]);
    }
  };
  int64_t p = 0;
  for (; p + U <= quads; p += U)
    for (int u = 0; u < U; ++u) step(u, p + u);
  for (; p < quads; ++p) step(0, p);
  for (int v = 0; v < V; ++v) {  // out = float(sum - 128 * wsum) * (xs[r] * scale), straight from the registers
    const int64_t c0 = n0 + v * kTileRows;
    if (c0 >= n) continue;
    const __mmask16 live = live_lanes(n - c0);
    const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(wsum + c0), 7);
    const __m512 sc = _mm512_maskz_loadu_ps(live, scale + c0);
    for (int r = 0; r < R; ++r) {
      __m512i sum = acc[0][r][v];
      for (int u = 1; u < U; ++u) sum = _mm512_add_epi32(sum, acc[u][r][v]);
      const __m512 value = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, off));
      _mm512_mask_storeu_ps(out + r * n + c0, live, _mm512_mul_ps(value, _mm512_mul_ps(_mm512_set1_ps(xs[r]), sc)));
    }
  }
#else
  int32_t sums[R][V][kTileRows] = {};
  for (int64_t p = 0; p < quads; ++p)
    for (int v = 0; v < V; ++v) {
      const int8_t* w = tile + v * stride + p * kInt8TileColumns * kTileRows;
      for (int r = 0; r < R; ++r)
        for (int64_t l = 0; l < kTileRows; ++l)
          for (int64_t i = 0; i < kInt8TileColumns; ++i)
            sums[r][v][l] += static_cast<int32_t>(xb[r * k + p * kInt8TileColumns + i]) * static_cast<int32_t>(w[l * kInt8TileColumns + i]);
    }
  for (int v = 0; v < V; ++v) {
    const int64_t c0 = n0 + v * kTileRows, count = std::min<int64_t>(kTileRows, n - c0);
    for (int r = 0; r < R; ++r)
      for (int64_t l = 0; l < count; ++l)
        out[r * n + c0 + l] = static_cast<float>(sums[r][v][l]) * (xs[r] * scale[c0 + l]);
  }
#endif
}

// The int8 format of `over_tiles` (tiled.h): kTileGroup blocks a pass; xb: x's rows as bytes (see `tiled_pass`).
struct Int8Tiles {
  const int8_t* xb;
  const float* xs;
  int64_t k;
  const int8_t* tiled;
  const int32_t* wsum;
  const float* scale;
  float* out;
  int64_t n;

  template <int R>
  static constexpr int blocks_per_pass() { return kTileGroup; }

  template <int R, int V>
  void pass(int64_t row, int64_t b) const {
    tiled_pass<R, V>(xb + row * k, xs + row, k, tiled + b * k * kTileRows, wsum, scale, out + row * n, n, b * kTileRows);
  }
};

// x [M, K] float32 or bfloat16 (unit-stride rows); data [N, K] int8, scale [N] float32. Returns [M, N] float32.
at::Tensor gemv_w8a8(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && data.dim() == 2 && x.size(1) == data.size(1) && x.stride(1) == 1 &&
                  data.scalar_type() == at::kChar && data.is_contiguous(),
              "gemv_w8a8: x [M, K] and a contiguous int8 weight [N, K] expected");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == data.size(0),
              "gemv_w8a8: one float32 scale per weight row expected");
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0);
  std::vector<int8_t> xq;
  std::vector<float> xs;
  quantized_rows(x, "gemv_w8a8", xq, xs);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const int8_t* w = data.data_ptr<int8_t>();
  const float* s_p = scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < m; r += kPassRows)
      group(xq.data() + r * k, xs.data() + r, std::min(kPassRows, m - r), k, w, s_p, o + r * n, n, begin, end);
  });
  return out;
}

// x [M, K] float32 or bfloat16 (unit-stride rows); tiled: an int8 weight [N, K] in the tiled layout, [blocks,
// K / 4, kTileRows, 4]; row_sums int32 [blocks * kTileRows]; scale [N] float32. Returns [M, N] float32, `gemv_w8a8`'s
// values to the bit.
at::Tensor tiled_w8a8(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& row_sums,
                      const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && tiled.dim() == 4 && tiled.scalar_type() == at::kChar &&
                  tiled.is_contiguous() && tiled.size(2) == kTileRows && tiled.size(3) == kInt8TileColumns &&
                  tiled.size(1) * kInt8TileColumns == x.size(1),
              "tiled_w8a8: x [M, K] and an int8 weight tiled as [blocks, K / 4, 16, 4] expected");
  const int64_t m = x.size(0), k = x.size(1), n = scale.numel(), blocks = tiled.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && blocks == (n + kTileRows - 1) / kTileRows,
              "tiled_w8a8: one float32 scale per weight row expected");
  TORCH_CHECK(row_sums.scalar_type() == at::kInt && row_sums.is_contiguous() && row_sums.numel() == blocks * kTileRows,
              "tiled_w8a8: one int32 row sum per tiled row expected");
  std::vector<int8_t> xq;
  std::vector<float> xs;
  quantized_rows(x, "tiled_w8a8", xq, xs);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  for (int8_t& v : xq) v = static_cast<int8_t>(static_cast<uint8_t>(v) ^ 0x80);  // xq + 128, as unsigned bytes
#endif
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const Int8Tiles format{xq.data(), xs.data(), k, tiled.data_ptr<int8_t>(), row_sums.data_ptr<int32_t>(),
                         scale.data_ptr<float>(), out.data_ptr<float>(), n};
  over_tiles(format, m, blocks);
  return out;
}

// x [M, K] float32 or bfloat16 (unit-stride rows) -> (xq int8 [M, K], xs float32 [M, 1]): `quantize_rows`'s values
// to the bit, the rows split across the threads (the activations of a many-row w8a8 product).
std::tuple<at::Tensor, at::Tensor> quantize_rows_op(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quantize_rows: x [M, K] with unit-stride rows expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quantize_rows: x must be float32 or bfloat16");
  const int64_t m = x.size(0), k = x.size(1), stride = x.stride(0);
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor xs = at::empty({m, 1}, x.options().dtype(at::kFloat));
  int8_t* q = xq.data_ptr<int8_t>();
  float* s = xs.data_ptr<float>();
  const auto run = [&](const auto* rows) {
    at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
      quantize_rows(rows + begin * stride, end - begin, k, stride, q + begin * k, s + begin);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>());
  } else {
    run(x.data_ptr<c10::BFloat16>());
  }
  return {xq, xs};
}

// acc int32 [M, N] (an exact integer product), xs float32 [M, 1], scale float32 [N] -> [M, N] in `dtype`:
// float(acc[m, n]) * (xs[m] * scale[n]), rounded once to dtype; `w8a8`'s (acc.float() * (xs * scale)).to(dtype)
// to the bit in one pass instead of four.
template <typename T>
void scaled_rows(const int32_t* acc, const float* xs, const float* scale, T* out, int64_t m, int64_t n) {
  at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* a = acc + r * n;
      const float s = xs[r];
      T* o = out + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = from_f<T>(static_cast<float>(a[j]) * (s * scale[j]));
    }
  });
}

at::Tensor scale_int32(const at::Tensor& acc, const at::Tensor& xs, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(),
              "scale_int32: a contiguous int32 acc [M, N] expected");
  const int64_t m = acc.size(0), n = acc.size(1);
  TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.is_contiguous() && xs.numel() == m,
              "scale_int32: one float32 scale per row of acc expected");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "scale_int32: one float32 scale per column of acc expected");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "scale_int32: float32 or bfloat16 out");
  at::Tensor out = at::empty({m, n}, acc.options().dtype(dtype));
  if (dtype == at::kFloat) {
    scaled_rows(acc.data_ptr<int32_t>(), xs.data_ptr<float>(), scale.data_ptr<float>(), out.data_ptr<float>(), m, n);
  } else {
    scaled_rows(acc.data_ptr<int32_t>(), xs.data_ptr<float>(), scale.data_ptr<float>(),
                out.data_ptr<c10::BFloat16>(), m, n);
  }
  return out;
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) {
  m.impl("gemv_w8a8", hyssm_cpu::gemv_w8a8);
  m.impl("tiled_w8a8", hyssm_cpu::tiled_w8a8);
  m.impl("quantize_rows", hyssm_cpu::quantize_rows_op);
  m.impl("scale_int32", hyssm_cpu::scale_int32);
}
