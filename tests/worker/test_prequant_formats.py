"""The pre-quantized formats' readers (worker_proc.loading.checkpoint_formats) and config
(worker_proc.loading.checkpoint_config):
compressed-tensors' 4-bit packing maps exactly onto the CPU 4-bit layout (symmetric and through the
zero point, bfloat16 and float32 scales); block-fp8 rows re-encode exactly where they can and are the
bfloat16 dequantization otherwise; a rank's part read from slices equals the same part of the whole;
slices that would cut a block or group are refused; unsupported methods and schemes are one-line
errors; `--quantization` must name the stored format; the dense weights of held sites are never built."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from shared.errors import ModelLoadError
from tests.fixtures.make_prequant import block_quantize, block_scales_full, write_fp8_block
from tests.worker.util import fixture_dir
from worker_proc.linear.formats import FP8_LINEAR
from worker_proc.loading.checkpoint import load_model
from worker_proc.loading.checkpoint_config import (
    CheckpointQuant,
    StoredScheme,
    check_requested,
    parse_quantization_config,
)
from worker_proc.loading.checkpoint_formats import Part
from worker_proc.loading.stored_methods import StoredBlockFp8Linear, stored_method
from worker_proc.model.shard import ShardSpec
from worker_proc.plan.execution_plan import product_sites
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

G = torch.Generator().manual_seed(3)
CPU = torch.device("cpu")


def read_module(read, prefix: str, scheme: StoredScheme, part: Part, device: torch.device, dense: bool):
    """Module `prefix`'s part as its scheme's method makes it: held in its format, or dequantized."""
    method = stored_method(scheme)
    return method.read_dense(read, prefix, part, device) if dense else method.read_weight(read, prefix, part, device)


def layout_problem(scheme: StoredScheme, part: Part, device: torch.device) -> str:
    return stored_method(scheme).layout_problem(part, device)


def _reader(tensors: dict[str, torch.Tensor]):
    def read(key: str, dim: int, ranges):
        t = tensors[key]
        return t if ranges is None else torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim=dim)
    return read


def _ct_int4(out: int, inp: int, group: int, symmetric: bool, scale_dtype: torch.dtype):
    """compressed-tensors' own packing of random 4-bit weights, and its own dequantization."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (out, inp), generator=G, dtype=torch.int8)
    scale = (torch.rand(out, inp // group, generator=G) * 0.05 + 0.001).to(scale_dtype)
    zp = torch.zeros(out, inp // group, dtype=torch.int8) if symmetric else \
        torch.randint(-8, 8, (out, inp // group), generator=G, dtype=torch.int8)
    tensors = {"m.weight_packed": pack_to_int32(q, 4), "m.weight_scale": scale,
               "m.weight_shape": torch.tensor([out, inp])}
    if not symmetric:
        tensors["m.weight_zero_point"] = pack_to_int32(zp, 4, packed_dim=0)
    full_s = scale.repeat_interleave(group, 1)
    full_zp = zp.repeat_interleave(group, 1).to(scale_dtype)
    return tensors, (q.to(scale_dtype) - full_zp) * full_s  # in the scale's dtype, as compressed-tensors does


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_packed_4bit_maps_exactly_onto_the_cpu_layout(symmetric: bool, scale_dtype: torch.dtype) -> None:
    tensors, want = _ct_int4(48, 256, 128, symmetric, scale_dtype)
    scheme = StoredScheme("int4", "weight_scale", "group", group=128, symmetric=symmetric)
    q = read_module(_reader(tensors), "m", scheme, Part((48, 256)), CPU, dense=False)
    q.check_integrity()
    assert q.group == 128
    dense = read_module(_reader(tensors), "m", scheme, Part((48, 256)), CPU, dense=True)
    assert torch.equal(dense.to(scale_dtype), want)  # the exact value, rounded once to the scale's dtype
    from worker_proc.loading.checkpoint_formats import narrow_int4

    held = narrow_int4(q)
    if scale_dtype == torch.bfloat16 and symmetric:  # s and z = 0 exact in bfloat16: the fast layout, bitwise
        assert held.scale.dtype == torch.bfloat16
        assert torch.equal(held.dequantize(torch.bfloat16), want)
    else:  # -zp * s of a bfloat16 s needs more bits: float32 (s, z), within float32 rounding
        assert held.scale.dtype == torch.float32
        assert torch.allclose(held.dequantize(), dense, rtol=0, atol=float(dense.abs().max()) * 2**-22)


def test_a_checkpoint_group_is_split_into_layout_groups_and_slices_line_up() -> None:
    tensors, want = _ct_int4(40, 256, 256, False, torch.float32)  # one group per row: layout group 128
    scheme = StoredScheme("int4", "weight_scale", "group", group=256, symmetric=False)
    whole = read_module(_reader(tensors), "m", scheme, Part((40, 256)), CPU, dense=True)
    assert torch.allclose(whole, want, rtol=1e-6, atol=0)
    rows = Part((40, 256), ShardSpec(0, ((3, 11), (21, 37))))  # zero-point words cut mid-word
    got = read_module(_reader(tensors), "m", scheme, rows, CPU, dense=True)
    assert torch.equal(got, torch.cat([whole[3:11], whole[21:37]]))
    assert layout_problem(scheme, Part((40, 256), ShardSpec(0, ((0, 16), (24, 40)))), CPU) == ""
    cols = Part((40, 256), ShardSpec(1, ((0, 64), (128, 192))))  # inside the 256-group: layout group 64
    assert layout_problem(scheme, Part((48, 256), cols.spec), CPU) == ""
    got = read_module(_reader(tensors), "m", scheme, cols, CPU, dense=True)
    assert torch.equal(got, torch.cat([whole[:, :64], whole[:, 128:192]], 1))
    with pytest.raises(ModelLoadError, match="cuts its 256-input groups"):
        layout_problem(scheme, Part((48, 256), ShardSpec(1, ((0, 48),))), CPU)
    assert "multiple of 16" in layout_problem(scheme, Part((40, 256)), CPU)


def test_block_fp8_rows_reencode_exactly_or_dequantize_to_bfloat16() -> None:
    w = torch.randn(70, 96, generator=G) * 0.02
    values, scale = block_quantize(w, (32, 32), pow2=False)
    scale[1, :] = scale[1, 0] * torch.tensor([1.0, 0.5, 0.25])  # rows 32-63: scales powers of two apart
    exact = values.float() * block_scales_full(scale, (32, 32), (70, 96))
    scheme = StoredScheme("fp8", "weight_scale_inv", "block", block=(32, 32))
    tensors = {"m.weight": values, "m.weight_scale_inv": scale}
    q = read_module(_reader(tensors), "m", scheme, Part((70, 96)), CPU, dense=False)
    q.check_integrity()
    assert q.group == 0 and q.data.dtype == torch.bfloat16
    got = q.dequantize()
    assert torch.equal(got[32:64], exact[32:64]) and bool((q.scale[32:64] != 1).all())
    assert torch.equal(got[:32], exact[:32].to(torch.bfloat16).float()) and bool((q.scale[:32] == 1).all())
    assert (got - exact).abs().max() <= exact.abs().max() * 2**-8
    part = Part((70, 96), ShardSpec(1, ((5, 29), (40, 77))))  # any cut on the CPU
    sliced = read_module(_reader(tensors), "m", scheme, part, CPU, dense=False).dequantize()
    whole = read_module(_reader(tensors), "m", scheme, Part((70, 96)), CPU, dense=True)
    assert torch.allclose(sliced, torch.cat([whole[:, 5:29], whole[:, 40:77]], 1), rtol=2**-8, atol=0)


def test_block_fp8_keeps_its_blocks_on_cuda_and_refuses_a_cut_block() -> None:
    scheme = StoredScheme("fp8", "weight_scale_inv", "block", block=(32, 32))
    cuda = torch.device("cuda")
    assert layout_problem(scheme, Part((70, 96), ShardSpec(0, ((32, 70),))), cuda) == ""
    with pytest.raises(ModelLoadError, match="rows 16-48 cuts its 32x32 blocks"):
        layout_problem(scheme, Part((70, 96), ShardSpec(0, ((16, 48),))), cuda)
    with pytest.raises(ModelLoadError, match="square blocks only"):
        layout_problem(StoredScheme("fp8", "weight_scale_inv", "block", block=(32, 64)), Part((70, 96)), cuda)


def _ct(weights: dict, fmt: str, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, **extra}}, "ignore": ["lm_head"]}


@pytest.mark.parametrize(("raw", "needle"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gguf"}, "quant_method 'gguf'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    (_ct({"num_bits": 2, "type": "int", "strategy": "group", "group_size": 128}, "pack-quantized"),
     "2-bit int group weights"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "actorder": "group"},
         "pack-quantized"), "activation-ordered"),
    (_ct({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False}, "int-quantized"),
     "asymmetric 8-bit"),
    (_ct({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, "nvfp4-pack-quantized"),
     "4-bit float"),
])
def test_unsupported_quantization_is_one_line_naming_it(raw: dict, needle: str) -> None:
    with pytest.raises(ModelLoadError, match=needle) as err:
        parse_quantization_config(raw, "x/config.json")
    assert "\n" not in str(err.value) and "x/config.json" in str(err.value)


def test_the_accepted_schemes_parse() -> None:
    w4 = parse_quantization_config(_ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                        "symmetric": False}, "pack-quantized"), "c")
    assert w4 is not None and w4.describe() == "compressed-tensors W4A16 group 128 asymmetric"
    assert w4.formats == {"int4"} and w4.ignored("lm_head") and not w4.ignored("model.layers.0.mlp.up_proj")
    fp8 = parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128],
                                     "modules_to_not_convert": ["lm_head"]}, "c")
    assert fp8 is not None and fp8.describe() == "fp8 e4m3 128x128 blocks" and fp8.ignore == ("lm_head",)
    assert parse_quantization_config(None, "c") is None


def test_quantization_flag_must_name_the_stored_format(tmp_path) -> None:
    quant = CheckpointQuant("fp8", (StoredScheme("fp8", "weight_scale_inv", "block", block=(128, 128)),))
    check_requested("", quant, "c")
    check_requested("fp8", quant, "c")
    with pytest.raises(ModelLoadError, match="--quantization int8 would re-quantize"):
        check_requested("int8", quant, "c")
    path = write_fp8_block("rope_moe", str(tmp_path / "fp8"))
    with pytest.raises(ModelLoadError, match="stored quantized"):
        ModelRunner(path, WorkerConfig(kv_slots=32, state_slots=2, quantization="int4"))


class _Allocations(TorchDispatchMode):
    """The shapes of every tensor `torch.empty` creates on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.empty.memory_format and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            self.shapes.append(tuple(out.shape))
        return out


def test_the_dense_weights_of_held_products_are_never_allocated(tmp_path) -> None:
    path = write_fp8_block("qwen3_5_moe", str(tmp_path / "fp8"), (128, 128))
    with _Allocations() as seen:
        model = load_model(path, dtype="float32")
    held = [(site.quantized.experts, *site.shape) if site.quantized.experts else site.shape
            for _, site, _ in product_sites(model) if site.quantized is not None]
    assert len(held) > 10
    assert not set(held) & set(seen.shapes)
    for _, site, weight in product_sites(model):
        assert (site.quantized is None) == (weight.numel() > 0)
        if site.quantized is not None:  # a held weight runs under its scheme's method, one shared per scheme
            assert isinstance(site.method, StoredBlockFp8Linear) and site.method.scheme.block == (128, 128)
            assert site.method.storage == "fp8" and site.method.candidates == FP8_LINEAR.candidates
    assert len({id(site.method) for _, site, _ in product_sites(model) if site.quantized is not None}) == 1
    with _Allocations() as dense:  # the control: a dense load allocates every one of them
        load_model(fixture_dir("qwen3_5_moe"), dtype="float32")
    assert set(held) <= set(dense.shapes)


def test_an_unsupported_checkpoint_fails_at_load(tmp_path) -> None:
    src = fixture_dir("rope_moe")
    out = tmp_path / "bnb"
    out.mkdir()
    cfg = json.loads(open(os.path.join(src, "config.json")).read())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({}, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="bitsandbytes"):
        load_model(str(out))
