"""Random-weight checkpoints with the real shapes of one model per family, and a decode-throughput
measurement on them.

    python -m benchmarks.make_family_model OUT_DIR --shape nemotron-nano-9b-v2 [--num-layers N] [--bench]
    python -m benchmarks.make_family_model OUT_DIR --shape lfm2-1.2b --layout transformers --dtype bfloat16

`SHAPES` holds the sizes of each model's published config.json (hidden size, heads, widths, state
size, groups, layer pattern, vocabulary); `--num-layers N` keeps the first N layers of the pattern
(at least one of each mixer kind the model has) so that a CPU can hold and run them.
Layouts (`--layout`):
- hyssm (the default, `write`): weights random (only speed is measured), float32, tensor names the
  loader's parameter names, which every family's renames accept but llama.cpp's GGUF converter and
  transformers do not; config.json only, no tokenizer;
- transformers (`write_transformers`): the model built by transformers' own class and config for the
  shape, with transformers' init (`torch.manual_seed(--seed)`), cast to --dtype and written by
  `save_pretrained` with the bench tokenizer (benchmarks.bench_tokenizer, whose bos / eos / pad ids the
  config takes): the checkpoint's own names and files, which hyssm, transformers and llama.cpp's
  converter read. The whole model is held in float32 while it is built.
`--bench` then serves a batch through `ModelRunner` (prefill, then decode steps) and logs decode tokens/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import tempfile
import time

import torch
from safetensors.torch import save_file

from benchmarks.bench_tokenizer import write_tokenizer

logger = logging.getLogger(__name__)

_QWEN_PATTERN = ["linear_attention"] * 3 + ["full_attention"]
_NANO9B_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
SHAPES: dict[str, dict] = {
    "nemotron-nano-9b-v2": dict(
        architectures=["NemotronHForCausalLM"], vocab_size=131072, hidden_size=4480,
        hybrid_override_pattern=_NANO9B_PATTERN, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        intermediate_size=15680, mamba_num_heads=128, mamba_head_dim=80, ssm_state_size=128, n_groups=8,
        conv_kernel=4, chunk_size=128, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5,
        max_position_embeddings=131072,
    ),
    "falcon-h1-0.5b": dict(
        architectures=["FalconH1ForCausalLM"], vocab_size=32784, hidden_size=1024, num_hidden_layers=36,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=2048, mamba_d_ssm=1536,
        mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
        mamba_chunk_size=128, mamba_rms_norm=False, rope_parameters={"rope_type": "default", "rope_theta": 1e11},
        max_position_embeddings=16384,
    ),
    "bamba-9b": dict(
        architectures=["BambaForCausalLM"], vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
        attn_layer_indices=[9, 18, 27], num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=262144,
    ),
    "mamba2-370m": dict(
        architectures=["Mamba2ForCausalLM"], vocab_size=50288, hidden_size=1024, num_hidden_layers=48,
        num_heads=32, head_dim=64, expand=2, n_groups=1, state_size=128, conv_kernel=4, chunk_size=256,
        tie_word_embeddings=True,
    ),
    "granite-4.0-h-tiny": dict(
        architectures=["GraniteMoeHybridForCausalLM"], vocab_size=100352, hidden_size=1536,
        layer_types=["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9
        + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 5,
        num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=128, mamba_expand=2, mamba_chunk_size=256, shared_intermediate_size=1024,
        intermediate_size=512, num_local_experts=64, num_experts_per_tok=6, position_embedding_type="nope",
        max_position_embeddings=131072,
    ),
    # Qwen3.5-0.8B's text model (the checkpoint is a Qwen3_5ForConditionalGeneration wrapper; hyssm
    # serves its text model, which is what this writes): 18 Gated DeltaNet + 6 gated attention layers
    "qwen3.5-0.8b": dict(
        architectures=["Qwen3_5ForCausalLM"], vocab_size=248320, hidden_size=1024, intermediate_size=3584,
        num_hidden_layers=24, layer_types=_QWEN_PATTERN * 6, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        max_position_embeddings=262144, eos_token_id=248044,
    ),
    # Qwen3-Next-80B-A3B: fused GDN projections, 512 experts (top-10) + gated shared expert per layer
    "qwen3-next-80b-a3b": dict(
        architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=5120,
        num_hidden_layers=48, layer_types=_QWEN_PATTERN * 12, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        max_position_embeddings=262144,
    ),
    # LFM2-1.2B: 10 gated short convolutions + 6 GQA attention layers, the hub's field spellings
    "lfm2-1.2b": dict(
        architectures=["Lfm2ForCausalLM"], vocab_size=65536, hidden_size=2048, num_hidden_layers=16,
        layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
        num_attention_heads=32, num_key_value_heads=8, block_ff_dim=12288, block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0, block_multiple_of=256, conv_L_cache=3, conv_bias=False, norm_eps=1e-5,
        tie_embedding=True, rope_theta=1000000.0, max_position_embeddings=128000, eos_token_id=7,
    ),
    # Kimi-Linear-48B-A3B: 20 KDA + 7 NoPE MLA layers (1-indexed 4, 8, ..., 24, 27), a dense first layer, then
    # 256 experts (top 8) with a shared one; layer_types spelled out (the hub lists them in linear_attn_config)
    "kimi-linear-48b-a3b": dict(
        architectures=["KimiLinearForCausalLM"], vocab_size=163840, hidden_size=2304, num_hidden_layers=27,
        layer_types=["full_attention" if i + 1 in (4, 8, 12, 16, 20, 24, 27) else "linear_attention"
                     for i in range(27)],
        num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True,
        linear_attn_config={"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
        intermediate_size=9216, moe_intermediate_size=1024, num_experts=256, num_experts_per_token=8,
        num_shared_experts=1, first_k_dense_replace=1, num_expert_group=1, topk_group=1, moe_renormalize=True,
        routed_scaling_factor=2.446, moe_router_activation_func="sigmoid", rms_norm_eps=1e-5,
        tie_word_embeddings=False, model_max_length=1048576, eos_token_id=163586,
    ),
    # Falcon-Mamba-7B: 64 Mamba1 layers (d_inner 8192, a [8192, 16] state each), no attention
    "falcon-mamba-7b": dict(
        architectures=["FalconMambaForCausalLM"], vocab_size=65024, hidden_size=4096, num_hidden_layers=64,
        intermediate_size=8192, state_size=16, conv_kernel=4, time_step_rank=256, use_conv_bias=True, use_bias=False,
        mixer_rms_eps=1e-6, layer_norm_epsilon=1e-5, tie_word_embeddings=False, eos_token_id=11,
    ),
}


def truncate(cfg: dict, n: int) -> dict:
    """The first `n` layers, keeping at least one layer of each kind (the last one moved in)."""
    out = dict(cfg)
    if "hybrid_override_pattern" in cfg:
        pat = cfg["hybrid_override_pattern"]
        head = pat[:n]
        for kind in dict.fromkeys(pat):
            if kind not in head:
                head = head[:-1] + kind
        out["hybrid_override_pattern"] = head
    elif "layer_types" in cfg:
        kinds = cfg["layer_types"][:n]
        for kind in dict.fromkeys(cfg["layer_types"]):
            if kind not in kinds:
                kinds[-1] = kind
        out["layer_types"], out["num_hidden_layers"] = kinds, n
    else:
        out["num_hidden_layers"] = n
        if cfg.get("attn_layer_indices"):
            out["attn_layer_indices"] = [i for i in cfg["attn_layer_indices"] if i < n] or [n - 1]
    return out


def write(out_dir: str, shape: str, num_layers: int = 0, seed: int = 0) -> str:
    from shared.families.registry import parse_config
    from worker_proc.model import HybridForCausalLM

    cfg = dict(SHAPES[shape], torch_dtype="float32")
    if num_layers:
        cfg = truncate(cfg, num_layers)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    with torch.device("meta"):
        model = HybridForCausalLM(parse_config(cfg), torch.float32, "meta")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            if p.dim() == 2:  # Mamba1's [d_inner, d_state]: every channel the same row of decays
                tensors[name] = torch.log(torch.linspace(1.0, 16.0, p.shape[-1])).expand(p.shape).contiguous()
            else:
                tensors[name] = torch.log(torch.linspace(1.0, 16.0, p.numel())).view(p.shape)
        elif p.dim() == 1:
            tensors[name] = torch.ones(p.shape) if "norm" in name or name.endswith(".D") else torch.zeros(p.shape)
        else:
            tensors[name] = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    logger.info("%s: %d layers, %.1fM parameters -> %s", shape, model.cfg.num_layers,
                sum(t.numel() for t in tensors.values()) / 1e6, out_dir)
    return out_dir


LAYOUTS = ("hyssm", "transformers")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def write_transformers(out_dir: str, shape: str, num_layers: int = 0, seed: int = 0, dtype: str = "float32",
                       fields: dict | None = None) -> str:  # fmt: skip
    """The transformers layout of `shape` (module docstring) into `out_dir`, which must not exist or be empty;
    `fields` replace the shape's config fields (a reduced model). Built in a sibling folder and renamed
    into place, so an interrupted write leaves no checkpoint. Raises ImportError without transformers,
    ValueError when its version has no class for the architecture, FileExistsError for a non-empty
    `out_dir`."""
    import transformers

    cfg = dict(SHAPES[shape], **(fields or {}))
    if num_layers:
        cfg = truncate(cfg, num_layers)
    arch = cfg.pop("architectures")[0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no {arch} (the {shape} shape)")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} is not empty; choose a new or empty directory")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.")
    try:
        os.chmod(tmp, 0o755)  # a checkpoint folder's usual mode, not mkdtemp's private one
        params = _save_transformers(tmp, cls, cfg, seed, DTYPES[dtype])
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("%s (%s, transformers' %s, %s): %.1fM parameters -> %s", shape, dtype, arch,
                f"{num_layers} layers" if num_layers else "all layers", params / 1e6, out_dir)  # fmt: skip
    return out_dir


def _save_transformers(out_dir: str, cls: type, cfg: dict, seed: int, dtype: torch.dtype) -> int:
    """The bench tokenizer and transformers' `cls` built from `cfg` (its ids set to the tokenizer's) into
    `out_dir`; the parameter count."""
    ids = write_tokenizer(out_dir, int(cfg["vocab_size"]))
    cfg = dict(cfg, bos_token_id=ids["eos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG state is left as it was
        torch.manual_seed(seed)
        model = cls(cls.config_class(**cfg))  # type: ignore[attr-defined]
    model.to(dtype).save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def bench_decode(model_dir: str, batch: int = 8, prompt: int = 64, steps: int = 16) -> float:
    """Decode tokens/s of `batch` requests after a `prompt`-token prefill each (greedy, fp32)."""
    from shared.messages import ForwardBatch, ReqSlice, SamplingParams
    from worker_proc.host.numerics import flush_denormals
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    flush_denormals()  # as a worker process does
    total = prompt + steps + 1
    r = ModelRunner(model_dir, WorkerConfig(dtype="float32", kv_slots=batch * total, state_slots=batch))
    greedy = SamplingParams(temperature=0.0)
    kv = [list(range(1 + i * total, 1 + (i + 1) * total)) for i in range(batch)]
    ids = [[3 + (i * 7 + j) % 200 for j in range(prompt)] for i in range(batch)]
    reqs = [ReqSlice(rid=str(i), input_ids=ids[i], start_pos=0, kv_slots=kv[i][:prompt], state_slot=i + 1,
                     sample=True, sampling=greedy) for i in range(batch)]
    out = r.step(ForwardBatch(step=0, reqs=reqs, clears=list(range(1, batch + 1))))
    start = time.perf_counter()
    for s in range(steps):
        pos = prompt + s
        reqs = [ReqSlice(rid=str(i), input_ids=[out.next_tokens[str(i)]], start_pos=pos, kv_slots=kv[i][: pos + 1],
                         state_slot=i + 1, sample=True, sampling=greedy, output_len=s + 1) for i in range(batch)]
        out = r.step(ForwardBatch(step=s + 1, reqs=reqs))
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--num-layers", type=int, default=0, help="keep the first N layers (0 = all)")
    p.add_argument("--layout", choices=LAYOUTS, default="hyssm",
                   help="hyssm: its parameter names, float32, no tokenizer; transformers: transformers' class, init "
                        "and save_pretrained with a tokenizer (what llama.cpp's converter reads)")  # fmt: skip
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights (--layout transformers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench", action="store_true", help="measure decode tokens/s on the written checkpoint")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.layout == "hyssm" and args.dtype != "float32":
        p.error("--layout hyssm writes float32 weights; --dtype is for --layout transformers")
    if args.layout == "transformers":
        try:
            path = write_transformers(args.out_dir, args.shape, args.num_layers, args.seed, args.dtype)
        except (ImportError, ValueError, FileExistsError) as e:
            p.error(str(e))
    else:
        path = write(args.out_dir, args.shape, args.num_layers, args.seed)
    if args.bench:
        logger.info("%s: %.1f decode tokens/s (batch 8, 64-token prompts, fp32)", args.shape, bench_decode(path))


if __name__ == "__main__":
    main()
