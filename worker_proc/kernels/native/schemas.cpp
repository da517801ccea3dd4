// Every op schema of `torch.ops.hyssm_cpu`, declared here once; each kernel's file registers only its CPU
// implementation (TORCH_LIBRARY_IMPL) and `OpProgram`'s file its class. `layout()` returns the layout constants
// the library was built with (worker_proc/kernels/native/layout.py, in its `LAYOUT` order), so the Python side
// can check that a build it loads agrees with it.
#include <torch/library.h>

#include <vector>

#include "layout.h"

namespace hyssm_cpu {
namespace {

std::vector<int64_t> layout() { return {kTileRows, kTileGroup, kPassRows, kInt8TileColumns, kInt4Chunk}; }

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY(hyssm_cpu, m) {
  m.def(
      "mamba_decode(Tensor xbc, Tensor dt, Tensor(a!) conv_pool, Tensor(b!) ssm_pool, Tensor(c!)? ssm_scale, "
      "Tensor slots, "
      "Tensor conv_w, Tensor? conv_b, Tensor a, Tensor d, Tensor dt_bias, Tensor? head_group, float dt_min, "
      "float dt_max, int groups) -> Tensor");
  m.def(
      "conv_prefill(Tensor x, Tensor(a!) conv_pool, int[] lengths, int[] slots, Tensor weight, Tensor? bias, "
      "bool silu=True) -> Tensor");
  m.def("short_conv_decode(Tensor bcx, Tensor(a!) conv_pool, Tensor slots, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "ssd_prefill(Tensor x, Tensor dt, Tensor b, Tensor c, Tensor(a!) ssm_pool, Tensor(b!)? ssm_scale, "
      "int[] lengths, int[] slots, "
      "Tensor a, Tensor d, Tensor dt_bias, float dt_min, float dt_max) -> Tensor");
  m.def("gated_rms_norm(Tensor y, Tensor z, Tensor? weight, int groups, float eps, bool before_gate, "
        "bool round_out) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int weighting) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor y, float alpha, Tensor weight, float eps, int weighting) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gemv_seq(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("tile_weight(Tensor weight, Tensor? out=None) -> Tensor");
  m.def("tiled_product(Tensor x, Tensor tiled, int out_features, Tensor? bias) -> Tensor");
  m.def("attn_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor kv_idx, Tensor lengths, float scale) -> Tensor");
  m.def("attn_prefill(Tensor q, Tensor k_pool, Tensor v_pool, Tensor kv_idx, int start, float scale, "
        "Tensor(a!) workspace) -> Tensor");
  m.def(
      "gdn_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) pool, "
      "Tensor(b!)? pool_scale, Tensor slots) -> Tensor");
  m.def(
      "kda_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) pool, "
      "Tensor(b!)? pool_scale, Tensor slots, int[] lengths) -> Tensor");
  m.def("expert_product(Tensor x, Tensor stack, Tensor? scale, Tensor idx, bool per_choice, bool sequential) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor data, Tensor scale, Tensor? bias) -> Tensor");
  m.def("gemv_w8a8(Tensor x, Tensor data, Tensor scale) -> Tensor");
  m.def("tiled_w8a8(Tensor x, Tensor tiled, Tensor row_sums, Tensor scale) -> Tensor");
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("scale_int32(Tensor acc, Tensor xs, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("tiled_w4a8(Tensor x, Tensor tiles, Tensor scales, int n) -> Tensor");
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor cols, Tensor row_slot) -> Tensor(a!)");
  m.def(
      "selective_scan(Tensor x, Tensor dt, Tensor b, Tensor c, Tensor a, Tensor d, Tensor dt_bias, Tensor(a!) pool, "
      "Tensor(b!)? pool_scale, Tensor slots, int[] lengths) -> Tensor");
  m.def("layout() -> int[]", &hyssm_cpu::layout);
}
