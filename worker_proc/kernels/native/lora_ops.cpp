// The LoRA terms of one linear layer over a step's rows, every adapter at once (worker_proc.lora.layer owns
// the stacked matrices; the execution plan's `lora_native_rows` says which steps take this op):
//   out[m] += (x[m] A_s^T) B_s^T,  s = row_slot[m],  A_s = a[lo_s:hi_s], B_s^T = bt[lo_s:hi_s], (lo_s, hi_s) = cols[s]
// a: every adapter's A [r, K] of the layer stacked on its rows; bt: their B^T [r, N] (scaling folded in)
// stacked the same way; cols [slots, 2]: each slot's rows of the stacks (lo == hi: no adapter here, the row is
// not touched). Rules that hold:
// - every output is computed from its own row alone, in one fixed order: h_j = x[m] . A_s[j] in float32
//   (sixteen-lane partial sums, reduced once), then out = round(out + sum_j h_j * B_s^T[j]) with the j sum
//   taken in order from zero; no h is rounded. So a row's result depends on neither the other rows, nor the
//   adapters loaded beside its own, nor how the threads split the work: the op is batch invariant;
// - out is written in place (its rows may have any stride, its columns unit stride); x may be any view.
#include <torch/library.h>

#include "cpu_common.h"

namespace hyssm_cpu {
namespace {

constexpr int64_t kVectors = 4;  // vectors of sixteen outputs of one row a task adds at once
constexpr int64_t kColumnChunk = 16 * kVectors;
constexpr int64_t kDots = 4;  // h values of a row taken in one pass over its x
constexpr int64_t kRows = 4;  // rows of one adapter whose passes share the loads of its matrices
constexpr int64_t kTaskWork = 32768;  // multiply-adds a parallel task takes at least

inline void store_as(float* p, vf16 v) { store16(p, v); }
inline void store_as(c10::BFloat16* p, vf16 v) {  // from_f<BFloat16>'s rounding, sixteen lanes at once
  vu32x16 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vu32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vu32x16 nan = (vu32x16)(v != v);
  const vu16x16 narrow = __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), vu16x16);
  std::memcpy(p, &narrow, sizeof(narrow));
}
inline void store_as(c10::Half* p, vf16 v) {
  float lanes[16];
  store16(lanes, v);
  for (int l = 0; l < 16; ++l) p[l] = from_f<c10::Half>(lanes[l]);
}

// A run of up to kRows consecutive rows under the same adapter: their passes share each load of its matrices.
struct RowRun {
  int64_t row, count, lo, width;
};

// h[rr][j] = x[rr] . w[j] for the R rows of a run and j < count (count <= kDots): each in sixteen-lane partial
// sums over x in order, reduced once, then the columns past the last full vector; the same arithmetic for every
// (row, j) however many share the pass.
template <typename T, int R>
void dots(const T* x, int64_t k, const T* w, int64_t count, float* h, int64_t h_stride) {
  vf16 acc[R][kDots];
  for (int rr = 0; rr < R; ++rr)
    for (int64_t j = 0; j < count; ++j) acc[rr][j] = vf16{};
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    vf16 xv[R];
    for (int rr = 0; rr < R; ++rr) xv[rr] = load16(x + rr * k + i);
    for (int64_t j = 0; j < count; ++j) {
      const vf16 wv = load16(w + j * k + i);
      for (int rr = 0; rr < R; ++rr) acc[rr][j] = xv[rr] * wv + acc[rr][j];
    }
  }
  for (int rr = 0; rr < R; ++rr)
    for (int64_t j = 0; j < count; ++j) {
      float s = sum16(acc[rr][j]);
      for (int64_t t = i; t < k; ++t) s += to_f(x[rr * k + t]) * to_f(w[j * k + t]);
      h[rr * h_stride + j] = s;
    }
}

// out[rr][n0 + 16 v ...] += sum_j h[rr][j] * bt[j][...] for the R rows of a run over `full` vectors of outputs,
// then the columns up to n1 one at a time; each output's sum taken over j in order from zero.
template <typename T, int R>
void terms(const float* h, int64_t h_stride, const T* b, int64_t n, int64_t width, int64_t n0, int64_t n1, T* o,
           int64_t o_stride) {
  const int64_t full = (n1 - n0) / 16;
  vf16 acc[R][kVectors];
  for (int rr = 0; rr < R; ++rr)
    for (int64_t v = 0; v < full; ++v) acc[rr][v] = vf16{};
  for (int64_t j = 0; j < width; ++j) {
    vf16 bv[kVectors];
    for (int64_t v = 0; v < full; ++v) bv[v] = load16(b + j * n + n0 + 16 * v);
    for (int rr = 0; rr < R; ++rr) {
      const vf16 hj = splat(h[rr * h_stride + j]);
      for (int64_t v = 0; v < full; ++v) acc[rr][v] = hj * bv[v] + acc[rr][v];
    }
  }
  for (int rr = 0; rr < R; ++rr) {
    T* row = o + rr * o_stride;
    for (int64_t v = 0; v < full; ++v) store_as(row + n0 + 16 * v, load16(row + n0 + 16 * v) + acc[rr][v]);
    for (int64_t col = n0 + 16 * full; col < n1; ++col) {
      float sum = 0.0f;
      for (int64_t j = 0; j < width; ++j) sum = h[rr * h_stride + j] * to_f(b[j * n + col]) + sum;
      row[col] = from_f<T>(to_f(row[col]) + sum);
    }
  }
}

// f<R>() for the run's row count R (1..kRows)
template <typename F>
void with_count(int64_t count, F&& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

template <typename T>
void add_terms(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const std::vector<RowRun>& runs, int64_t rmax) {
  const int64_t m = x.size(0), k = x.size(1), n = bt.size(1), out_stride = out.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t groups = (rmax + kDots - 1) / kDots, hs = groups * kDots;
  std::vector<float> h(static_cast<size_t>(m * hs));
  const int64_t runs_n = static_cast<int64_t>(runs.size());
  const int64_t dot_work = std::max<int64_t>(1, k * kDots * kRows);
  at::parallel_for(0, runs_n * groups, std::max<int64_t>(1, kTaskWork / dot_work), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const RowRun& run = runs[t / groups];
      const int64_t j0 = (t % groups) * kDots, count = std::min(kDots, run.width - j0);
      if (count <= 0) continue;
      with_count(run.count, [&](auto c) {
        dots<T, decltype(c)::value>(xp + run.row * k, k, ap + (run.lo + j0) * k, count, h.data() + run.row * hs + j0, hs);
      });
    }
  });
  const int64_t chunks = (n + kColumnChunk - 1) / kColumnChunk;
  const int64_t chunk_work = std::max<int64_t>(1, m * rmax * kColumnChunk);
  at::parallel_for(0, chunks, std::max<int64_t>(1, kTaskWork / chunk_work), [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * kColumnChunk, n1 = std::min(n, n0 + kColumnChunk);
      for (const RowRun& run : runs)
        with_count(run.count, [&](auto cnt) {
          terms<T, decltype(cnt)::value>(h.data() + run.row * hs, hs, bp + run.lo * n, n, run.width, n0, n1,
                                         op + run.row * out_stride, out_stride);
        });
    }
  });
}

}  // namespace

at::Tensor lora_add(at::Tensor out, const at::Tensor& x_in, const at::Tensor& a, const at::Tensor& bt,
                    const at::Tensor& cols, const at::Tensor& row_slot) {
  TORCH_CHECK(x_in.dim() == 2 && out.dim() == 2 && a.dim() == 2 && bt.dim() == 2, "lora_add: 2-D tensors expected");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(out.size(0) == m && out.stride(1) == 1, "lora_add: out must be [", m, ", N] with unit-stride rows");
  TORCH_CHECK(a.size(1) == k && bt.size(1) == n && a.size(0) == bt.size(0) && a.is_contiguous() && bt.is_contiguous(),
              "lora_add: a [C, ", k, "] and bt [C, ", n, "] (contiguous) expected");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && a.scalar_type() == out.scalar_type() &&
              bt.scalar_type() == out.scalar_type(), "lora_add: x, out, a and bt must share a dtype");
  TORCH_CHECK(cols.dim() == 2 && cols.size(1) == 2 && cols.scalar_type() == at::kLong && row_slot.dim() == 1 &&
              row_slot.size(0) == m && row_slot.scalar_type() == at::kLong,
              "lora_add: cols [slots, 2] and row_slot [M] int64 expected");
  const at::Tensor c = cols.contiguous(), s = row_slot.contiguous();
  const int64_t* cp = c.data_ptr<int64_t>();
  const int64_t* sp = s.data_ptr<int64_t>();
  std::vector<RowRun> runs;
  int64_t rmax = 0;
  for (int64_t row = 0; row < m; ++row) {
    const int64_t slot = sp[row];
    TORCH_CHECK(slot >= 0 && slot < c.size(0), "lora_add: row ", row, " has slot ", slot, " outside 0..", c.size(0) - 1);
    const int64_t lo = cp[2 * slot], width = cp[2 * slot + 1] - lo;
    TORCH_CHECK(lo >= 0 && width >= 0 && lo + width <= a.size(0), "lora_add: slot ", slot,
                "'s rows of the stacks are out of range");
    if (width == 0) continue;
    rmax = std::max(rmax, width);
    RowRun* last = runs.empty() ? nullptr : &runs.back();
    if (last != nullptr && last->lo == lo && last->width == width && last->row + last->count == row && last->count < kRows)
      ++last->count;
    else
      runs.push_back(RowRun{row, 1, lo, width});
  }
  if (runs.empty()) return out;
  AT_DISPATCH_SWITCH(out.scalar_type(), "hyssm_lora_add",
    AT_DISPATCH_CASE(at::kFloat, [&] { add_terms<float>(out, x, a, bt, runs, rmax); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { add_terms<c10::BFloat16>(out, x, a, bt, runs, rmax); })
    AT_DISPATCH_CASE(at::kHalf, [&] { add_terms<c10::Half>(out, x, a, bt, runs, rmax); }));
  return out;
}

}  // namespace hyssm_cpu

TORCH_LIBRARY_IMPL(hyssm_cpu, CPU, m) { m.impl("lora_add", hyssm_cpu::lora_add); }
