// The w4a8 product (worker_proc.quant.weight `tiled_w4a8`): the rows of x quantized to int8 with a float32 scale
// each (xq, xs: int8_rows.h), a 4-bit weight q in [0, 15] with a bfloat16 scale s and offset z per output row and
// group of G inputs (w = (q - 8) * s + z, the int4 format of worker_proc.quant.weight);
// out[r, n] = xs[r] * sum_g (s * S + (z - 8 * s) * X), with S = sum over the group of q * xq (exact, int32) and
// X = the group's sum of xq; float32 out. Rules that hold:
// - the weight is read from a tiled copy: blocks of kTileRows outputs, [ceil(N / kTileRows)][K / 8][kTileRows][4] bytes,
//   byte i of output l at chunk c holding inputs 8c + i (low nibble) and 8c + 4 + i (high nibble), outputs past
//   N zero; the scales as [ceil(N / kTileRows)][K / G][2][kTileRows] bfloat16 (s for each output of the block, then
//   z). One 64-byte vector of a block holds eight inputs of kTileRows outputs: its two nibble halves each meet four
//   bytes of a row of x broadcast in one AVX512-VNNI instruction (unsigned 4-bit values by signed bytes), so no
//   sum is reduced across lanes;
// - each output's value depends on its own row of x only and is computed in one order whatever the row count,
//   the thread count or the instructions (the group sums are exact; each group adds s * S, then (z - 8 s) * X,
//   in single fused multiply-adds): batch invariant, the same bits on every thread count;
// - the blocks are traversed as every tiled product's are (tiled.h `over_tiles`), up to three side by side in one
//   pass.
#include <torch/library.h>

#include "cpu_common.h"
#include "layout.h"
#include "int8_rows.h"
#include "tiled.h"

namespace hyssm_cpu {
namespace {


inline float bf16_value(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &word, sizeof(v));
  return v;
}

// Where the tensors of one call are: x's rows (xq, stride k; their group sums xg, stride groups; scales xs) and
// the weight's blocks (tiles, stride k * kTileRows / 2 bytes; scales, stride groups * 2 * kTileRows).
struct W4Operands {
  const int8_t* xq;
  const int32_t* xg;
  const float* xs;
  const uint8_t* tiles;
  const uint16_t* scales;
  int64_t k, group, n;
};

// R rows of x over V blocks starting at block b.
template <int R, int V>
inline void w4_pass(const W4Operands& o, int64_t b, float* out) {
  const int64_t groups = o.k / o.group, chunks = o.group / kInt4Chunk;
  const int64_t stride = o.k * kTileRows / 2, sstride = groups * 2 * kTileRows;
  const uint8_t* tile = o.tiles + b * stride;
  const uint16_t* sz = o.scales + b * sstride;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sums[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) sums[r][v] = _mm512_setzero_si512();
    for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c) {
      __m512i lo[V], hi[V];
      for (int v = 0; v < V; ++v) {
        const __m512i raw = _mm512_loadu_si512(tile + v * stride + c * 64);
        lo[v] = _mm512_and_si512(raw, low4);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      }
      for (int r = 0; r < R; ++r) {
        int32_t first, second;
        std::memcpy(&first, o.xq + r * o.k + c * kInt4Chunk, 4);
        std::memcpy(&second, o.xq + r * o.k + c * kInt4Chunk + 4, 4);
        const __m512i x0 = _mm512_set1_epi32(first), x1 = _mm512_set1_epi32(second);
        for (int v = 0; v < V; ++v) {
          sums[r][v] = _mm512_dpbusd_epi32(sums[r][v], lo[v], x0);
          sums[r][v] = _mm512_dpbusd_epi32(sums[r][v], hi[v], x1);
        }
      }
    }
    for (int v = 0; v < V; ++v) {
      const uint16_t* p = sz + v * sstride + g * 2 * kTileRows;
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kTileRows))), 16));
      const __m512 offset = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), s, z);
      for (int r = 0; r < R; ++r) {
        acc[r][v] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(sums[r][v]), acc[r][v]);
        acc[r][v] = _mm512_fmadd_ps(offset, _mm512_set1_ps(static_cast<float>(o.xg[r * groups + g])), acc[r][v]);
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t c0 = (b + v) * kTileRows;
    if (c0 >= o.n) continue;
    const __mmask16 live = o.n - c0 >= kTileRows ? __mmask16(0xffff) : __mmask16((1u << (o.n - c0)) - 1);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + r * o.n + c0, live, _mm512_mul_ps(acc[r][v], _mm512_set1_ps(o.xs[r])));
  }
#else
  for (int v = 0; v < V; ++v) {
    const int64_t c0 = (b + v) * kTileRows, count = std::min<int64_t>(kTileRows, o.n - c0);
    const uint8_t* t = tile + v * stride;
    const uint16_t* p = sz + v * sstride;
    for (int r = 0; r < R; ++r)
      for (int64_t l = 0; l < count; ++l) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t sum = 0;
          for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c)
            for (int64_t i = 0; i < 4; ++i) {
              const uint8_t byte = t[(c * kTileRows + l) * 4 + i];
              sum += static_cast<int32_t>(byte & 0x0f) * o.xq[r * o.k + c * kInt4Chunk + i];
              sum += static_cast<int32_t>(byte >> 4) * o.xq[r * o.k + c * kInt4Chunk + 4 + i];
            }
          const float s = bf16_value(p[g * 2 * kTileRows + l]), z = bf16_value(p[g * 2 * kTileRows + kTileRows + l]);
          acc = std::fma(s, static_cast<float>(sum), acc);
          acc = std::fma(std::fma(-8.0f, s, z), static_cast<float>(o.xg[r * groups + g]), acc);
        }
        out[r * o.n + c0 + l] = acc * o.xs[r];
      }
  }
#endif
}

// The 4-bit format of `over_tiles` (tiled.h): as many blocks a pass as R rows leave registers for.
struct Int4Tiles {
  W4Operands operands;
  int64_t groups;
  float* out;

  template <int R>
  static constexpr int blocks_per_pass() { return R <= 2 ? 3 : (R <= 4 ? 2 : 1); }

  template <int R, int V>
  void pass(int64_t row, int64_t b) const {
    W4Operands rows = operands;
    rows.xq += row * operands.k;
    rows.xg += row * groups;
    rows.xs += row;
    w4_pass<R, V>(rows, b, out + row * operands.n);
  }
};

// x [M, K] float32 or bfloat16 (unit-stride rows); tiles uint8 [blocks, K / 8, 16, 4]; scales bfloat16
// [blocks, K / G, 2, 16]; n <= blocks * 16 outputs. Returns [M, n] float32.
at::Tensor tiled_w4a8(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && tiles.dim() == 4 && tiles.scalar_type() == at::kByte &&
                  tiles.is_contiguous() && tiles.size(2) == kTileRows && tiles.size(3) == 4 &&
                  tiles.size(1) * kInt4Chunk == x.size(1),
              "tiled_w4a8: x [M, K] and a 4-bit weight tiled as [blocks, K / 8, 16, 4] bytes expected");
  const int64_t m = x.size(0), k = x.size(1), blocks = tiles.size(0);
  TORCH_CHECK(scales.dim() == 4 && scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  scales.size(0) == blocks && scales.size(1) > 0 && k % scales.size(1) == 0 &&
                  (k / scales.size(1)) % kInt4Chunk == 0 && scales.size(2) == 2 && scales.size(3) == kTileRows,
              "tiled_w4a8: scales [blocks, K / G, 2, 16] bfloat16 expected, G a multiple of 8");
  TORCH_CHECK(n > (blocks - 1) * kTileRows && n <= blocks * kTileRows, "tiled_w4a8: ", n, " outputs for ", blocks,
              " blocks of 16");
  const int64_t groups = scales.size(1), group = k / groups;
  std::vector<int8_t> xq;
  std::vector<float> xs;
  quantized_rows(x, "tiled_w4a8", xq, xs);
  std::vector<int32_t> xg(m * groups, 0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < k; ++j) xg[r * groups + j / group] += xq[r * k + j];
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const W4Operands operands{xq.data(), xg.data(), xs.data(), tiles.data_ptr<uint8_t>(),
                            reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()), k, group, n};
  over_tiles(Int4Tiles{operands, groups, out.data_ptr<float>()}, m, blocks);
  return out;
}

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) {
  m.impl("tiled_w4a8", hyssm_cpu::tiled_w4a8);
}
