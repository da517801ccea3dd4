// The layouts of the weight copies the tiled products read and the row counts one pass over a weight serves:
// defined once, in worker_proc/kernels/native/layout.py, and given to every build as compiler definitions
// (`layout.defines`), so that the Python side that makes the copies and the kernels that read them cannot
// disagree. `with_rows` turns a run-time row count into the template argument of the kernels whose sums
// stay in registers.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#if !defined(HYSSM_TILE_ROWS) || !defined(HYSSM_TILE_GROUP) || !defined(HYSSM_PASS_ROWS) || \
    !defined(HYSSM_INT8_TILE_COLUMNS) || !defined(HYSSM_INT4_CHUNK)
#error "build with worker_proc/kernels/native/layout.py's defines()"
#endif

namespace hyssm_cpu {

constexpr int64_t kTileRows = HYSSM_TILE_ROWS;                // output rows of one tiled block: one vector of sums
constexpr int64_t kTileGroup = HYSSM_TILE_GROUP;              // blocks one pass reads side by side
constexpr int64_t kPassRows = HYSSM_PASS_ROWS;                // input rows sharing one pass over a weight
constexpr int64_t kInt8TileColumns = HYSSM_INT8_TILE_COLUMNS;  // input columns of a row side by side, int8 tiles
constexpr int64_t kInt4Chunk = HYSSM_INT4_CHUNK;              // inputs of one 64-byte vector of a 4-bit tile

template <int R, int Max, typename F>
inline void with_rows_from(int64_t rows, F&& f) {
  if constexpr (R >= Max) {
    f(std::integral_constant<int, Max>{});
  } else {
    if (rows <= R) return f(std::integral_constant<int, R>{});
    with_rows_from<R + 1, Max>(rows, std::forward<F>(f));
  }
}

// f(std::integral_constant<int, R>{}) for R = min(max(rows, 1), Max).
template <int Max, typename F>
inline void with_rows(int64_t rows, F&& f) {
  with_rows_from<1, Max>(rows, std::forward<F>(f));
}

}  // namespace hyssm_cpu
