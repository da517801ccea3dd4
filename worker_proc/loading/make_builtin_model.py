"""Build the tiny built-in checkpoint in `worker_proc/builtin_model/` (config.json + model.safetensors).

Run by hand (not at install or test time):

    python -m worker_proc.loading.make_builtin_model [--train-steps N]   (default N = 400, ~2 min on 2 cores)

Deterministic (fixed seed). Vocabulary is fixed by contract with the tokenizer files that live in
the same folder (made by tokenizer_proc/make_builtin_tokenizer.py): ids 0..255 are the 256 byte tokens of
a ByteLevel tokenizer, 256 = <|end_of_text|> (bos and eos), 257 = <|start_of_role|>,
258 = <|end_of_role|>, 259 = <|pad|>. With `--train-steps N > 0` (the default; the committed
checkpoint) the random weights are then trained for N steps on the embedded text below with
transformers (needed only then), so the model continues prompts with English-looking bytes from
that text; it was never trained to emit <|end_of_text|>, so generation normally runs to its
token limit. `--train-steps 0` gives random weights using only this package.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os

import torch
from safetensors.torch import save_file

from shared.families.registry import parse_config
from shared.model_config import HybridConfig

logger = logging.getLogger(__name__)

OUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "builtin_model")
SEED = 20240611
EOS, START_ROLE, END_ROLE, PAD = 256, 257, 258, 259
DEFAULT_TRAIN_STEPS = 400

CONFIG: dict = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "vocab_size": 260,
    "hidden_size": 128,
    "num_hidden_layers": 6,
    "layer_types": ["mamba", "mamba", "attention", "mamba", "mamba", "attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_multiplier": 1.0 / math.sqrt(32),
    "position_embedding_type": None,
    "max_position_embeddings": 4096,
    "mamba_n_heads": 8,
    "mamba_n_groups": 1,
    "mamba_d_state": 32,
    "mamba_d_head": 32,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 64,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "time_step_limit": [0.0, {"__float__": "Infinity"}],
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "intermediate_size": 256,
    "shared_intermediate_size": 256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "logits_scaling": 1.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "bos_token_id": EOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
    "torch_dtype": "float32",
    "use_cache": True,
}
STORAGE_DTYPE = torch.bfloat16
"""The weights are stored in bfloat16 (half the file) and served in float32 (`torch_dtype`, what `--dtype auto`
serves): the built-in model's outputs are then the same on every machine, whatever 16-bit arithmetic it has."""

TEXT = (
    "The quick brown fox jumps over the lazy dog. A small model can still learn the shape of words. "
    "Hybrid models mix state space layers with attention layers. The state space layers carry a fixed "
    "size state from token to token, and the attention layers read every earlier token. Serving such a "
    "model means keeping two kinds of memory: the key and value cache of attention, and the recurrent "
    "state of each sequence. When many requests share a prefix, the server can reuse both. "
    "Hello! How are you today? I am fine, thank you. What would you like to talk about? "
    "Let us write a short story. Once upon a time there was a little robot who liked to count the stars. "
    "Every night it counted one more star than the night before, and it was never tired. "
)


def _init_weights(cfg: HybridConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random float32 weights with the checkpoint's names (Granite-style init, std 0.02)."""
    from worker_proc.model.hybrid import HybridForCausalLM

    shapes = {n: tuple(p.shape) for n, p in HybridForCausalLM(cfg, torch.float32, "meta").named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("A_log"):
            out[name] = torch.log(torch.arange(1, shape[0] + 1, dtype=torch.float32))
        elif name.endswith(".D"):
            out[name] = torch.ones(shape)
        elif name.endswith("dt_bias"):
            out[name] = torch.rand(shape, generator=gen) * 2.0 - 3.0
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            out[name] = torch.ones(shape)
        elif name.endswith("conv1d.bias"):
            out[name] = torch.zeros(shape)
        elif name.endswith("conv1d.weight"):
            out[name] = torch.randn(shape, generator=gen) * (1.0 / math.sqrt(shape[-1]))
        else:
            out[name] = torch.randn(shape, generator=gen) * 0.02
    return out


def _train(config: dict, weights: dict[str, torch.Tensor], steps: int, gen: torch.Generator) -> None:
    """Train in place with transformers' GraniteMoeHybridForCausalLM (byte-level LM on TEXT)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    hf_cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf_cfg["layer_types"] = ["linear_attention" if k == "mamba" else "full_attention" for k in config["layer_types"]]
    hf_cfg["time_step_limit"] = (0.0, float("inf"))
    model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**hf_cfg))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"weight names differ from transformers: {missing} {unexpected}")
    model.tie_weights()
    data = torch.tensor([EOS, *TEXT.encode()], dtype=torch.int64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    seq, batch = 96, 8
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            logger.info("train step %d loss %.3f", step, loss.item())
    state = model.state_dict()
    for name in weights:
        weights[name] = state[name].detach().float().clone()


def build(train_steps: int, out_dir: str = OUT_DIR) -> None:
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    cfg = parse_config(
        {**CONFIG, "time_step_limit": [0.0, float("inf")]}, "make_builtin_model.CONFIG"
    )
    weights = _init_weights(cfg, gen)
    if train_steps > 0:
        _train(CONFIG, weights, train_steps, gen)
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.to(STORAGE_DTYPE).contiguous() for k, v in sorted(weights.items())},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(CONFIG, f, indent=2, sort_keys=True)
        f.write("\n")
    logger.info("wrote %s (%d tensors, train_steps=%d)", out_dir, len(weights), train_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-steps", type=int, default=DEFAULT_TRAIN_STEPS)
    parser.add_argument("--out-dir", default=OUT_DIR)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build(args.train_steps, args.out_dir)


if __name__ == "__main__":
    main()
