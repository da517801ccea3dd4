"""`HybridForCausalLM`: one decoder for every family, assembled from the shared blocks as the
family's `HybridConfig.layers()` arranges them, over one flattened step.

Per layer, for each `Sublayer` (shared.model_config):

    h = h + multiplier * sum(out_multiplier * block(in_multiplier * norm(h)) for block in blocks)

with embeddings scaled by `embedding_multiplier` and logits multiplied by `lm_head_multiplier`
and divided by `logits_scaling`. Module names are the blocks' names under `model.layers.N`, so the
checkpoint's tensor names (after the family's renames, applied by the loader) are this module's
`state_dict` keys: `model.embed_tokens`, `model.layers.N.<norm>`, `model.layers.N.<block>.*`,
`model.norm`, `lm_head`.
Recurrent mixers (Mamba2, Gated DeltaNet, LFM2's short convolutions, Mamba1) read and advance their layer's
tensors of the worker's state pools (`pools.layer_state(kind, i)`, the same way for every recurrent
mixer kind: the conv windows and the recurrent state, if the kind has one, in its storage dtype, int8
values with their scales) at the request's state slot; attention its layer's KV pool.
Tensor parallelism: the constructor takes `tp`; every block is built with this rank's sizes and
names the slice of each of its tensors (`shard_spec`, rules in worker_proc.model.tp). Mixers
all-reduce their own output; MLP and MoE blocks return partial sums, all-reduced once per
sublayer. The residual stream `h` (float32 with `residual_fp32`, worker_proc.model.residual) is whole
and identical on every rank; embedding, norms and LM head are replicated (every rank computes the logits).
Images (a checkpoint with a vision tower, `HybridConfig.vision`): `visual` is the tower
(worker_proc.model.vision, replicated under tensor parallelism, its tensors `visual.*`) and
`encoder_cache` its outputs by image digest (worker_proc.model.encoder_cache); a step's image rows
(`StepBatch.image_spans`) take their image's encoding in place of the (scaled) token embedding, the
images the cache lacks encoded in one tower call. With multimodal RoPE (`AttentionConfig.mrope_section`)
the rotary tables are made from the batch's [3, T] `rope_positions`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shared.errors import ModelLoadError
from shared.messages import ImageInput
from shared.model_config import HybridConfig, Sublayer, tp_layout_error
from worker_proc.kernels import KernelOps
from worker_proc.linear.site import GemmOwner, GemmSite
from worker_proc.model.attention import rope_cos_sin
from worker_proc.model.batch import StepBatch
from worker_proc.model.blocks import ATTENTION_MIXERS, RECURRENT_MIXERS, build_block
from worker_proc.model.encoder_cache import EncoderCache
from worker_proc.model.latent_attention import LatentAttention
from worker_proc.model.layers import GatedMLP, Linear, SplitGatedMLP, empty_param, make_norm
from worker_proc.model.residual import Residual
from worker_proc.model.shard import ShardSpec, TPInfo
from worker_proc.model.vision import VisionTower
from worker_proc.quant.weight import QuantizedWeight
from worker_proc.state.pools import StatePools

__all__ = ["DecoderLayer", "HybridForCausalLM", "HybridModel", "TPInfo"]

_LAYER_PARAM = re.compile(r"^(model|mtp)\.layers\.(\d+)\.([^.]+)\.(.+)$")

HEAD_TIMED_ROWS = 64
"""Rows the plan times the LM head at: it takes a step's sampled rows (a decode batch), and timing it
over a prefill chunk's rows (a 100k-vocabulary head at 512 rows is ~80 GFLOP) would cost seconds."""


class StepAdapters(Protocol):
    """A rank's adapter slots as the model's step sees them (worker_proc.lora.slots.LoraSlots): told which rows of
    the step run under which slot before the layers run, and when they are done."""

    def begin(self, lora_rows: tuple[tuple[int, tuple[tuple[int, int], ...]], ...], row_slot: torch.Tensor | None,
              rows: int) -> None: ...

    def end(self) -> None: ...


class KVLayers(Protocol):
    """Where a layer's attention keeps its KV: `k[i]`, `v[i]` [slots, kv_heads, head_dim] of attention
    layer i (the state pools' for the model's layers; worker_proc.spec.mtp_drafting's for the MTP layers)."""

    k: Sequence[torch.Tensor]
    v: Sequence[torch.Tensor]


class DecoderLayer(nn.Module):
    """Layer `index` of the model, or (`mtp`) MTP layer `index`: the family's MTP arrangement, its
    attention reading MTP KV layer `index`."""

    def __init__(self, cfg: HybridConfig, index: int, dtype: torch.dtype, device: torch.device, tp: TPInfo,
                 mtp: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.tp = tp
        self.subs: tuple[Sublayer, ...] = cfg.mtp_spec if mtp else cfg.layers()[index]
        self.kind = "attention" if mtp else cfg.layer_kinds[index]
        for sub in self.subs:
            self.add_module(sub.norm, make_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset,
                                                cfg.norm_fp32_weight))
            for block in sub.blocks:
                self.add_module(block.name, build_block(block, cfg, dtype, device, tp))
        if mtp:
            self.attn_index, self.state_index = index, {}
            return
        self.attn_index = cfg.attn_layer_ids.index(index) if index in cfg.attn_layer_ids else -1
        # this layer's index among the layers of each recurrent kind that it has
        kinds = (("mamba", cfg.mamba_layer_ids), ("gdn", cfg.gdn_layer_ids), ("short_conv", cfg.short_conv_layer_ids),
                 ("kda", cfg.kda_layer_ids), ("mamba1", cfg.mamba1_layer_ids))
        self.state_index = {kind: ids.index(index) for kind, ids in kinds if index in ids}

    def _run(self, module: nn.Module, x: torch.Tensor, batch: StepBatch,
             rope: tuple[torch.Tensor, torch.Tensor] | None, pools: KVLayers, ops: KernelOps) -> torch.Tensor:
        if isinstance(module, RECURRENT_MIXERS):
            assert isinstance(pools, StatePools)
            conv, state = pools.layer_state(module.state_kind, self.state_index[module.state_kind])
            return module(x, batch, conv, state, ops)
        if isinstance(module, ATTENTION_MIXERS):
            i = self.attn_index
            return module(x, batch, rope, pools.k[i], pools.v[i], ops)
        if isinstance(module, (GatedMLP, SplitGatedMLP)):
            return module(x, ops)
        return module(x)

    def forward(
        self,
        stream: Residual,
        batch: StepBatch,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        pools: KVLayers,
        ops: KernelOps,
    ) -> Residual:
        """Every sublayer over the residual `stream`; the last one's output is left pending in it."""
        for sub in self.subs:
            x = stream.normed(getattr(self, sub.norm), ops)
            whole: torch.Tensor | None = None  # sum of all-reduced block outputs
            partial: torch.Tensor | None = None  # sum of this rank's partial sums
            for block in sub.blocks:
                module = getattr(self, block.name)
                out = self._run(module, x if block.in_multiplier == 1.0 else x * block.in_multiplier,
                                batch, rope, pools, ops)
                if block.out_multiplier != 1.0:
                    out = out * block.out_multiplier
                if module.reduced:
                    whole = out if whole is None else whole + out
                else:
                    partial = out if partial is None else partial + out
            if partial is not None:
                partial = self.tp.all_reduce(partial)  # one sum of every MLP/MoE partial
            y = partial if whole is None else (whole if partial is None else whole + partial)
            stream.add(y, sub.multiplier, ops)
        return stream


class HybridModel(nn.Module):
    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device, tp) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset,
                              cfg.norm_fp32_weight)


class MtpHead(nn.Module):
    """The checkpoint's multi-token prediction layers (`mtp.*`, built for --speculative-algorithm NEXTN).
    Row i of a step takes the embedding of the token after it and the model's final-normed hidden
    state at i: `fc([pre_fc_norm_embedding(e) | pre_fc_norm_hidden(h)])`, one MTP layer (attention over
    the MTP layer's own KV at the step's slots, then the MLP), `norm`; the model's LM head turns that
    into a guess of the token two after row i, and the result is the hidden state of the next guess."""

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        hidden = cfg.hidden_size

        def norm() -> nn.Module:
            return make_norm(hidden, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset, cfg.norm_fp32_weight)

        self.fc = Linear(2 * hidden, hidden, bias=False, dtype=dtype, device=device)
        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.norm = norm()
        self.layers = nn.ModuleList(DecoderLayer(cfg, j, dtype, device, tp, mtp=True) for j in range(cfg.mtp_layers))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: StepBatch,
                rope: tuple[torch.Tensor, torch.Tensor] | None, kv: KVLayers, ops: KernelOps,
                layer: int = 0) -> torch.Tensor:  # fmt: skip
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[layer](Residual(x), batch, rope, kv, ops).value(ops))


class HybridForCausalLM(nn.Module, GemmOwner):
    """The whole model. `forward_step` is the only entry point the runtime calls."""

    def __init__(
        self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device | str, tp: TPInfo | None = None,
        mtp: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp or TPInfo()
        if not 0 <= self.tp.rank < self.tp.size:
            raise ValueError(f"tensor-parallel rank {self.tp.rank} outside [0, {self.tp.size})")
        problem = tp_layout_error(cfg, self.tp.size)
        if problem:
            raise ModelLoadError(problem)
        device = torch.device(device)
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.model = HybridModel(cfg, dtype, device, self.tp)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device,
                        timed_rows=HEAD_TIMED_ROWS)
        )
        self.head_gemm = GemmSite(cfg.vocab_size, cfg.hidden_size, dtype, packable=True, dense_kept=True,
                                  timed_rows=HEAD_TIMED_ROWS)  # a tied LM head over the embedding table
        if mtp and not cfg.mtp_layers:
            raise ModelLoadError(f"{cfg.architecture}: the checkpoint has no MTP layers (mtp_num_hidden_layers or "
                                 "num_nextn_predict_layers in config.json) to draft with")
        self.mtp = MtpHead(cfg, dtype, device, self.tp) if mtp else None
        self.visual = VisionTower(cfg.vision, dtype, device) if cfg.vision.depth else None
        self.encoder_cache = EncoderCache()
        """The tower's outputs by image digest (the runner sizes it: WorkerConfig.encoder_cache_bytes)."""
        self.rope_axes: torch.Tensor | None = None
        """The position axis of each rotary frequency (multimodal RoPE), made once (`derive_buffers`)."""
        self.derive_buffers(device)
        self.embed_rows: QuantizedWeight | None = None
        """The quantized rows the embedding lookups read once a tied head is quantized (the table's dense
        copy is then gone; worker_proc.loading.quantize)."""
        self.lora: StepAdapters | None = None
        """The rank's adapter slots when it serves LoRA adapters (worker_proc.lora.slots sets it)."""

    def derive_buffers(self, device: torch.device) -> None:
        """The tensors made from the config alone, on `device` (again when a meta-built model is materialised)."""
        axes = self.cfg.attn.rope_axes()
        self.rope_axes = torch.tensor(axes, dtype=torch.int64, device=device) if axes else None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `ids` in the model dtype."""
        q = self.embed_rows
        if q is None:
            return F.embedding(ids, self.model.embed_tokens.weight)
        return (q.data[ids].float() * q.scale[ids][:, None]).to(self.dtype)

    def shard_spec(self, name: str) -> ShardSpec | None:
        """Which slice of checkpoint tensor `name` (parameter name) this rank holds; None = whole.
        The block owning the tensor decides; embedding, norms and LM head are replicated."""
        if self.tp.size == 1:
            return None
        m = _LAYER_PARAM.match(name)
        if m is None:
            return None
        owner = self.model if m.group(1) == "model" else self.mtp
        layers = owner.layers if owner is not None else ()
        index = int(m.group(2))
        module = getattr(layers[index], m.group(3), None) if index < len(layers) else None
        spec = getattr(module, "shard_spec", None)
        return spec(m.group(4)) if callable(spec) else None

    def after_loading(self) -> None:
        """Once the checkpoint's tensors are in (worker_proc.loading.checkpoint), before quantization and
        the execution plan: each module's own `absorb` (an MLA layer's kv_b_proj into its per-head products)."""
        for module in self.modules():
            if isinstance(module, LatentAttention):
                module.absorb()

    @property
    def ignored_prefixes(self) -> tuple[str, ...]:
        """Checkpoint tensors not loaded: the family's, less the MTP layers when they are built."""
        kept = ("mtp.",) if self.mtp is not None else ()
        return tuple(p for p in self.cfg.ignored_prefixes if p not in kept)

    def shard_for_rank(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part of the whole checkpoint tensor `name` this rank holds."""
        spec = self.shard_spec(name)
        return tensor if spec is None else spec.apply(tensor)

    def gemm_weights(self) -> Iterator[tuple[GemmSite, nn.Module, str]]:
        """A tied LM head's site over the embedding table."""
        if self.lm_head is None:
            yield self.head_gemm, self.model.embed_tokens, "weight"

    @torch.inference_mode()
    def forward_step(
        self, batch: StepBatch, pools: StatePools, ops: KernelOps, want_logits: bool = True
    ) -> torch.Tensor:
        """Run every layer over the step's rows, writing KV and advancing recurrent state in place.
        Returns float32 logits [len(batch.logit_rows), vocab] (already scaled); with
        `want_logits=False` (ranks that do not sample) the LM head is skipped: [0, vocab]."""
        stream = self.run_stream(batch, pools, ops)
        if not want_logits:
            return stream.h.new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
        return self.logits(stream.final_normed(self.model.norm, ops, rows=batch.logit_rows))

    def run_layers(self, batch: StepBatch, pools: StatePools, ops: KernelOps) -> torch.Tensor:
        """The residual stream after the last layer (before the final norm), every row, in the model dtype."""
        return self.run_stream(batch, pools, ops).value(ops).to(self.dtype)

    def run_stream(self, batch: StepBatch, pools: StatePools, ops: KernelOps) -> Residual:
        """Every layer over the step's rows; the last layer's output is left pending in the stream."""
        h = self.embed_scaled(batch.input_ids)
        if batch.image_spans:
            self.place_images(h, batch)
        stream = Residual(h, self.cfg.residual_fp32)
        rope = self.rope(batch.rope_input)
        lora = self.lora if batch.lora_rows else None
        if lora is not None:  # the linear layers add each slot's term to its rows (worker_proc.lora.layer)
            lora.begin(batch.lora_rows, batch.lora_row_slot, h.shape[0])
        try:
            for layer in self.model.layers:
                layer(stream, batch, rope, pools, ops)
        finally:
            if lora is not None:
                lora.end()
        return stream

    def embed_scaled(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return h * self.cfg.embedding_multiplier if self.cfg.embedding_multiplier != 1.0 else h

    def place_images(self, h: torch.Tensor, batch: StepBatch) -> None:
        """Write each image row's encoding over its embedding in `h` (in place)."""
        encodings = self.image_encodings(batch.images)
        for span in batch.image_spans:
            rows = span.row_end - span.row_start
            h[span.row_start : span.row_end] = encodings[span.digest][span.first : span.first + rows]

    def image_encodings(self, images: Sequence[ImageInput]) -> dict[str, torch.Tensor]:
        """Every image's encoding [tokens, hidden] by digest: from the encoder cache, the others from one
        tower call over all of them (then kept in the cache)."""
        if self.visual is None:
            raise ValueError("images in a step, but the model has no vision tower")
        found: dict[str, torch.Tensor] = {}
        missing: list[ImageInput] = []
        for img in images:
            enc = self.encoder_cache.get(img.digest)
            if enc is None:
                missing.append(img)
            else:
                found[img.digest] = enc
        if missing:
            dim = self.cfg.vision.patch_dim
            pixels = torch.cat([torch.frombuffer(bytearray(img.pixels), dtype=torch.float32).view(-1, dim)
                                for img in missing]).to(self.device)
            out = self.visual(pixels, [img.grid for img in missing])
            for img, enc in zip(missing, out.split([self.visual.tokens(img.grid) for img in missing]), strict=True):
                found[img.digest] = enc.clone()  # its own storage: the cache counts and frees it alone
                self.encoder_cache.put(img.digest, found[img.digest])
        return found

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary tables of `positions`: [T], or with multimodal RoPE [3, T] ([T] taken as text rows)."""
        cfg = self.cfg
        if cfg.attn.rope_theta is None or not (cfg.attn_layer_ids or cfg.mtp_layers):
            return None
        if self.rope_axes is not None and positions.dim() == 1:
            positions = positions.expand(3, -1)
        return rope_cos_sin(positions, cfg.attn.rope_dim, cfg.attn.rope_theta, self.dtype, self.rope_axes)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed hidden states `h`, scaled as the family says."""
        cfg = self.cfg
        if self.lm_head is not None:
            logits = self.lm_head(h).float()
        else:
            logits = self.head_gemm.apply(h, self.model.embed_tokens.weight).float()
        # in place: the product's result is this call's own, and a vocabulary-wide temporary per op costs
        # its pages again on every step
        if cfg.lm_head_multiplier != 1.0:
            logits.mul_(cfg.lm_head_multiplier)
        return logits.div_(cfg.logits_scaling) if cfg.logits_scaling != 1.0 else logits
