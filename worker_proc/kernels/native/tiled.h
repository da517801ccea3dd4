// The traversal every tiled product shares (tile_ops.cpp's dense `tiled_product`, w8a8_ops.cpp's `tiled_w8a8`,
// w4a8_ops.cpp's `tiled_w4a8`), written once: a weight copy laid out in blocks of kTileRows output rows
// (layout.h), the threads taking contiguous ranges of kTileGroup blocks (one sequential stream each), every
// range read once per call for up to kPassRows input rows at a time, the later row passes reading it from
// cache. What differs between formats is one pass: R input rows over V blocks side by side, with the sums
// kept in registers. A format is a struct with
//   template <int R> static constexpr int blocks_per_pass();  // V for R rows (what R rows leave registers for)
//   template <int R, int V> void pass(int64_t row, int64_t block) const;  // rows [row, row + R), blocks
//                                                                          // [block, block + V)
// and the order each output's sum is taken in is the format's pass alone: the traversal decides which
// thread computes an output and when, never how.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>

#include "layout.h"

namespace hyssm_cpu {

template <typename Format>
void over_tiles(const Format& format, int64_t rows, int64_t blocks) {
  at::parallel_for(0, (blocks + kTileGroup - 1) / kTileGroup, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * kTileGroup, b1 = std::min(blocks, b0 + kTileGroup);
      for (int64_t row = 0; row < rows; row += kPassRows)
        with_rows<kPassRows>(rows - row, [&](auto count) {
          constexpr int R = decltype(count)::value;
          constexpr int V = Format::template blocks_per_pass<R>();
          int64_t b = b0;
          for (; b + V <= b1; b += V) format.template pass<R, V>(row, b);
          for (; b < b1; ++b) format.template pass<R, 1>(row, b);
        });
    }
  });
}

}  // namespace hyssm_cpu
