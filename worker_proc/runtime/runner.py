"""`ModelRunner`: the worker rank's model + state pools + sampler behind one `step()` call.

The worker process (worker_proc/process.py) owns the sockets and calls `step` once per
`ForwardBatch`. The scheduler owns every slot number; the runner holds the tensors (weights, KV
pool, Mamba state pools) and one mirror of the KV slot lists of the last batch it ran
(`KVSlotMirror`, so slices may send only new slots: ReqSlice.kv_reuse). Within one step the order is
fixed: read the batch's adapter loads (worker_proc.lora.slots), validate and index the non-refused slices
(a malformed batch or an unreadable adapter raises before anything is written), the loaded adapters into
their slots, copies (minus refused requests' copies), then clears, then one forward over every
non-refused slice (each slice's rows under its adapter slot), then sampling. Under tensor parallelism
every rank runs the same step on its shard (weights and pools, see worker_proc.model.tp; all ranks get
identical batches and agree on refusals, so their mirrors stay identical); only rank 0 computes logits and
samples, the other ranks' StepResult carries no tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch

from shared.heap import release_free_heap
from shared.messages import ForwardBatch, ReqSlice, StepResult
from shared.model_info import ModelInfo
from worker_proc.host.memory import blocks_mapped
from worker_proc.host.numerics import denormals_flushed, flush_subnormal_
from worker_proc.host.setup import apply_steps_policy
from worker_proc.host.threads import available_cores
from worker_proc.loading.checkpoint import checkpoint_quantization, load_model
from worker_proc.loading.checkpoint_config import check_requested
from worker_proc.loading.quantize import QuantScheme, quantize_model
from worker_proc.lora.slots import LoraSlots, StagedLoad
from worker_proc.model import StepBatch, build_step_batch
from worker_proc.model.encoder_cache import EncoderCache
from worker_proc.model.kv_mirror import KVSlotMirror
from worker_proc.output.grammar import GrammarRuntime
from worker_proc.output.sampling import SampleRequest, greedy_params, sample, top_logprobs
from worker_proc.plan.execution_plan import ExecutionPlan, product_sites
from worker_proc.plan.kernel_set import KernelChoice, choose_kernels
from worker_proc.plan.source import plan_for
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.step_replay import StepReplays
from worker_proc.spec import verify as speculative
from worker_proc.spec.mtp_drafting import MtpDrafter
from worker_proc.state.pools import (
    StatePools,
    attention_free_kv_slots,
    cpu_wanted_budget,
    plan_capacities,
    pool_budget,
    slot_bytes,
)

logger = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model runtime. Attributes read by the worker process: `kv_capacity`,
    `state_capacity` (usable slots, padding slot 0 excluded), `model_info`, `device`, `dtype`.
    `state_dtype` (`--mamba-ssm-dtype`) is how the state pools store the recurrent states; the
    capacities planned from the memory budget count its bytes per slot. On the CPU the allocator's steps'
    policy applies once the weights are loaded (worker_proc.host.setup.apply_steps_policy), so the plan is
    timed as steps run; the copies it binds are mappings of their own (`host.memory.blocks_mapped`). Built from one
    `WorkerConfig` (worker_proc.runtime.config); `tp_group` is the rank's process group (None: one rank)."""

    def __init__(self, model_dir: str, config: WorkerConfig | None = None, tp_group: object = None) -> None:
        c = config or WorkerConfig()
        self.config = c
        self.model_info = ModelInfo.from_dir(model_dir)
        self.device = torch.device(c.device)
        # a bad --kernels fails before the weights load
        has_gdn = "gdn" in self.model_info.layer_kinds
        kernel_choice = choose_kernels(self.device, c.kernels, c.deterministic, has_gdn=has_gdn,
                                       has_kda="kda" in self.model_info.layer_kinds)
        if self.device.type == "cpu" and not denormals_flushed():
            logger.warning("rank %d: subnormal floats are not flushed on every thread (worker_proc.host.numerics): "
                           "products over them run many times slower", c.tp_rank)
        stored = checkpoint_quantization(model_dir)
        if stored is not None:  # held as stored; --quantization may only name that format
            check_requested(c.quantization, stored, model_dir)
        with_mtp = c.speculative_algorithm == "NEXTN"
        self.model = load_model(
            model_dir, device=self.device, dtype=c.dtype, tp_rank=c.tp_rank, tp_size=c.tp_size, tp_group=tp_group,
            mtp=with_mtp,
        )
        self.model.encoder_cache = EncoderCache(c.encoder_cache_bytes)
        flushed = flush_subnormal_(self.model)
        if flushed:
            logger.info("rank %d: %d subnormal weight elements set to zero", c.tp_rank, flushed)
        if c.quantization and stored is None:
            quantize_model(self.model, QuantScheme(c.quantization, lm_head=c.quantize_lm_head))
        if self.device.type == "cpu":
            apply_steps_policy(c.tp_rank)
        self._make_plan(kernel_choice)
        self.loras = LoraSlots(self.model, c.max_loras, c.max_lora_rank, self.plan.lora_kernel(),
                               self.plan.lora_native_rows()) if c.max_loras else None
        """The adapter slots (worker_proc.lora.slots), None when LoRA is off (WorkerConfig.max_loras 0)."""
        self.cfg = self.model.cfg
        self.dtype = self.model.dtype
        self.seed = c.seed
        self.tp_rank = c.tp_rank
        self._make_pools(with_mtp)
        self.drafter = MtpDrafter(self.model, self.kv_capacity) if with_mtp else None
        self.ops = kernel_choice.build()
        # decode steps replay their recorded calls where the rules of worker_proc.runtime.step_replay allow
        self.replays = StepReplays(not c.enforce_eager and c.tp_size == 1 and kernel_choice.ops == "native")
        self.replays.lora_native_rows = self.loras.native_rows if self.loras is not None else 0
        self.kv_mirror = KVSlotMirror()  # slot lists of the last batch run (ReqSlice.kv_reuse)
        self.grammars = GrammarRuntime(model_dir, self.model_info.vocab_size, self.model_info.eos_token_ids)

    def _make_plan(self, kernel_choice: KernelChoice) -> None:
        """The rank's execution plan (worker_proc.plan), bound to the model."""
        c = self.config
        self.plan = dataclasses.replace(
            plan_for(self.model, self.device, deterministic=c.deterministic, thread_options=c.thread_options,
                     cores=available_cores(), pinned=c.execution_plan, cache_dir=c.plan_cache_dir,
                     ops=kernel_choice.build(), single_copy=c.single_weight_copy),
            kernels=kernel_choice,
        )
        self._bind(self.plan)
        if self.device.type == "cpu":
            release_free_heap()
        logger.info("rank %d execution plan (%s, %s):%s", c.tp_rank, self.plan.mode, self.plan.source,
                    "".join(f"\n  {line}" for line in self.plan.describe()))

    def _make_pools(self, with_mtp: bool) -> None:
        """The KV and state pools, sized by the config or planned from the memory budget."""
        c = self.config
        mtp_kv = self.cfg.mtp_layers if with_mtp else 0
        kv, mamba, how = c.kv_slots, c.state_slots, "--max-total-tokens and --max-mamba-cache-size"
        if kv <= 0 or mamba <= 0:
            wanted = cpu_wanted_budget(self.cfg, self.dtype, c.running_requests, c.state_ratio, c.tp_size, c.tp_rank,
                                       c.state_dtype)
            budget, how = pool_budget(self.device, c.mem_budget_bytes, c.mem_fraction_static, wanted)
            how = f"{budget / 2**30:.3f} GiB from {how}"
            planned_kv, planned_states = plan_capacities(self.cfg, budget, c.state_ratio, self.dtype, c.tp_size,
                                                         c.tp_rank, c.state_dtype, mtp_kv)
            kv = kv if kv > 0 else planned_kv
            mamba = mamba if mamba > 0 else planned_states
        if not self.cfg.attn_layer_ids:  # no KV tensor: the slots are only the scheduler's bookkeeping
            kv = attention_free_kv_slots(c.kv_slots, mamba, self.model_info.max_position_embeddings)
        self.pools = StatePools(self.cfg, kv, mamba, self.dtype, self.device, c.tp_size, c.tp_rank, c.state_dtype)
        self.kv_capacity = kv
        self.state_capacity = mamba
        self.state_dtype = c.state_dtype
        sb = slot_bytes(self.cfg, self.dtype, c.tp_size, c.tp_rank, c.state_dtype, mtp_kv)
        logger.info("rank %d pools on %s (%s): %d KV token slots, %d state slots; recurrent state dtype %s, "
                    "%d B per state slot, %d B per KV token", c.tp_rank, self.device, how, kv, mamba, c.state_dtype,
                    sb.state_slot, sb.kv_token)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self, batch: ForwardBatch, refused: frozenset[str] = frozenset()) -> StepResult:
        """Validate and index the non-refused slices, apply state ops, run one forward, sample. See
        module doc. Any exception leaves the KV slot mirror empty (the step failed)."""
        t0 = time.perf_counter()
        reqs = [r for r in batch.reqs if r.rid not in refused]
        sampled: dict[str, Any] = {}
        images = self.model.encoder_cache
        encoded, hits = images.encoded, images.hits
        if batch.ended:
            self.grammars.forget(batch.ended)
        try:
            staged = self.stage_adapters(batch)  # read before anything is written: a load that fails fails the step
            sb = self.build_batch(reqs, batch.step, all_rows=False, staged=staged)  # raises before anything is written
            self.apply_state_ops(batch, refused, staged)
            if reqs:
                self.plan.apply_threads(int(sb.input_ids.numel()))
                sampler = self.tp_rank == 0  # rank 0 samples and replies; the others only advance state
                speculative.back_up(self.pools, reqs)
                hidden = None
                if self.drafter is None:
                    logits = self.forward(sb, want_logits=sampler)
                else:  # the MTP layers read the final-normed hidden state of every row
                    h = self.model.run_layers(sb, self.pools, self.ops)
                    final_norm = self.model.model.norm
                    logits = self.model.logits(self.ops.rms_norm(final_norm, h[sb.logit_rows])) if sampler else h[:0]
                    hidden = self.ops.rms_norm(final_norm, h)
                if sb.logit_rids and sampler:
                    sampled = self._sample(logits, reqs)
                if sb.kept_inputs is not None or hidden is not None:
                    self._after_sampling(sb, reqs, sampled, hidden)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except BaseException:
            self.kv_mirror.clear()
            raise
        self.kv_mirror.commit(batch.step, [r.rid for r in reqs], sb.kv_full)
        elapsed = time.perf_counter() - t0
        if logger.isEnabledFor(logging.DEBUG):
            rows = sum(len(r.input_ids) for r in reqs)
            logger.debug("step %d: %d slices, %d rows (%d decoding), %.1f ms", batch.step, len(reqs), rows,
                         sum(len(r.input_ids) == 1 for r in reqs), 1000.0 * elapsed)
        return StepResult(
            step=batch.step,
            refused=sorted(refused),
            **sampled,
            elapsed_s=elapsed,
            images_encoded=images.encoded - encoded,
            images_cached=images.hits - hits,
        )

    def forward(self, sb: StepBatch, want_logits: bool = True) -> torch.Tensor:
        """The model's forward over `sb` (float32 logits of its logit rows), replayed where a program of
        worker_proc.runtime.step_replay may run it."""
        return self.replays.forward(sb, want_logits,
                                    lambda: self.model.forward_step(sb, self.pools, self.ops, want_logits=want_logits))

    def bind_plan(self, plan: ExecutionPlan) -> None:
        """Bind `plan` to the model in place of the one bound: the recorded steps, which hold the weights as
        bound before, are dropped."""
        self._bind(plan)
        self.replays.clear()
        if self.loras is not None:
            self.loras.kernel, self.loras.native_rows = plan.lora_kernel(), plan.lora_native_rows()
            self.replays.lora_native_rows = self.loras.native_rows

    def _bind(self, plan: ExecutionPlan) -> None:
        """The one place a runner's model is bound; on the CPU the copies the plan makes are mappings of their
        own (`host.memory.blocks_mapped`)."""
        with blocks_mapped() if self.device.type == "cpu" else contextlib.nullcontext():
            plan.bind(self.model)

    def _after_sampling(self, sb: StepBatch, reqs: list[ReqSlice], sampled: dict[str, Any],
                        hidden: torch.Tensor | None) -> None:  # fmt: skip
        """Every rank learns rank 0's verdict (accepted counts; with MTP layers the sampled tokens too),
        leaves the verify slices' states after their accepted tokens and runs the MTP layers."""
        accepted, tokens = sampled.get("accepted", {}), sampled.get("next_tokens", {})
        verdict = [accepted.get(r.rid, 0) for r in reqs]
        if hidden is not None:
            verdict += [tokens.get(r.rid, -1) for r in reqs]
        shared = self.model.tp.broadcast_first(torch.tensor(verdict, dtype=torch.int64, device=self.device)).tolist()
        n = len(reqs)
        if sb.kept_inputs is not None:
            counts = [shared[i] for i, r in enumerate(reqs) if r.drafts]
            speculative.roll_back(self.pools, sb, reqs, counts, self.ops)
        if hidden is not None and self.drafter is not None:
            drafts = self.drafter.step(sb, reqs, hidden, shared[n:], shared[:n], self.ops)
            if drafts and self.tp_rank == 0:
                sampled["drafts"] = drafts

    def stage_adapters(self, batch: ForwardBatch) -> list[StagedLoad]:
        """The batch's adapter loads read and checked (`LoraSlots.stage`), not yet in their slots."""
        if not batch.lora_loads:
            return []
        if self.loras is None:
            raise ValueError("adapter loads in a batch, but this worker serves no adapters (max_loras 0)")
        return self.loras.stage(batch.lora_loads)

    def apply_state_ops(self, batch: ForwardBatch, refused: frozenset[str] = frozenset(),
                        staged: list[StagedLoad] | None = None) -> None:  # fmt: skip
        """The staged adapters into their slots, then copies (skipping refused requests' copy-on-write), then
        clears; in message order."""
        if staged and self.loras is not None:
            self.loras.commit(staged)
            self.replays.clear()  # the programs hold the slots' tensors as they were
        for op in batch.copies:
            if op.rid is not None and op.rid in refused:
                continue
            self.pools.copy_state(op.src, op.dst)
        for slot in batch.clears:
            self.pools.clear_state(slot)

    def build_batch(self, reqs: list[ReqSlice], step: int, all_rows: bool,
                    staged: list[StagedLoad] | None = None) -> StepBatch:  # fmt: skip
        """Validate and index `reqs` against this runner's capacities, KV slot mirror and adapter slots (with
        `staged` loads in theirs; raises ValueError on a malformed batch, before anything is written).
        `all_rows`: a logit row for every input position of a sampled slice, not only its last."""
        if self.drafter is None and any(r.draft_next for r in reqs):
            raise ValueError("draft_next in a batch, but this worker has no MTP layers (--speculative-algorithm NEXTN)")
        return build_step_batch(
            reqs, self.device, self.kv_capacity, self.state_capacity, bool(self.cfg.state_layer_ids), all_rows,
            uses_attention=bool(self.cfg.attn_layer_ids), mirror=self.kv_mirror, step=step,
            verify_by_token=self.plan.kernels.verify_by_token, vision=self.cfg.vision,
            mrope=self.model.rope_axes is not None,
            lora_slots=frozenset() if self.loras is None else self.loras.slots_after(staged or []),
        )

    def _sample(self, logits: torch.Tensor, reqs: list[ReqSlice]) -> dict[str, Any]:
        """Sampling and logprobs of one step: the StepResult fields, from the logit rows of `reqs`
        (in slice order: every row of a prompt-logprob slice, else the last row of a sampling one)."""
        sample_rows: list[int] = []
        sreqs: list[SampleRequest] = []
        prompt: list[tuple[ReqSlice, int, int]] = []  # (slice, first row, rows)
        verify: list[tuple[ReqSlice, int]] = []  # (verify slice, its first draw)
        at = 0
        for r in reqs:
            n = len(r.input_ids) if r.prompt_logprobs >= 0 or r.drafts else (1 if r.sample else 0)
            if r.prompt_logprobs >= 0:
                prompt.append((r, at, n))
            if r.drafts:
                verify.append((r, len(sreqs)))
                sample_rows.extend(range(at, at + n))
                sreqs.extend(speculative.position_requests(r))
            elif r.sample:
                sample_rows.append(at + n - 1)
                sreqs.append(SampleRequest(r.rid, r.sampling or greedy_params(), r.output_len, r.history))
            at += n
        out: dict[str, Any] = {}
        if sreqs:
            if sample_rows == list(range(logits.shape[0])):
                rows = logits  # every row samples, in order (a decode step): no gathered copy
            else:
                rows = logits[torch.tensor(sample_rows, dtype=torch.int64, device=logits.device)]
            want = any(s.params.logprobs or s.params.top_logprobs for s in sreqs)
            eos = tuple(self.model_info.eos_token_ids)
            errors: dict[str, str] = {}
            constrain = self.grammars.constrain(sreqs, errors) if any(s.params.grammar for s in sreqs) else None
            tokens, lps = sample(rows, sreqs, self.seed, want_logprobs=want, eos_ids=eos, constrain=constrain)
            out["next_tokens"] = {s.rid: t for s, t in zip(sreqs, tokens, strict=True)}
            if verify:
                out["accepted"] = {}
                for r, first in verify:
                    n_ok = speculative.accepted_drafts(r, tokens[first : first + r.drafts + 1], eos)
                    out["accepted"][r.rid], out["next_tokens"][r.rid] = n_ok, tokens[first + n_ok]
            starts = {first: r.drafts for r, first in verify}
            if constrain is not None or errors:
                made = speculative.emitted(sreqs, tokens, starts, out.get("accepted", {}))
                rejected: set[str] = set()
                out["grammar_done"] = self.grammars.accept(*made, errors, rejected)
                out["grammar_errors"], out["grammar_rejected"] = errors, sorted(rejected)
            out.update(self._token_logprobs(rows, sreqs, lps, starts, out.get("accepted", {})))
        if prompt:
            out["prompt_logprobs"], out["prompt_top_logprobs"], out["prompt_ranks"] = self._prompt_logprobs(logits,
                                                                                                         prompt)
        return out

    @staticmethod
    def _token_logprobs(rows: torch.Tensor, sreqs: list[SampleRequest], lps: list[float] | None,
                        starts: dict[int, int], accepted: dict[str, int]) -> dict[str, Any]:
        """The StepResult's `logprobs` / `top_logprobs`: per request that asked, those of the draws
        that became its output tokens (`speculative.emitted`'s), in order."""
        ks = [s.params.top_logprobs for s in sreqs]
        if lps is None and not any(ks):
            return {}
        tops = top_logprobs(torch.log_softmax(rows, dim=-1), ks) if any(ks) else None
        kept = speculative.emitted_rows(sreqs, starts, accepted)
        out: dict[str, Any] = {"logprobs": {}, "top_logprobs": {}}
        for i in kept:
            s = sreqs[i]
            if lps is not None and s.params.logprobs:
                out["logprobs"].setdefault(s.rid, []).append(lps[i])
            if tops is not None and ks[i]:
                out["top_logprobs"].setdefault(s.rid, []).append(tops[i])
        return out

    @staticmethod
    def _prompt_logprobs(
        logits: torch.Tensor, slices: list[tuple[ReqSlice, int, int]]
    ) -> tuple[dict[str, list[float]], dict[str, list[list[tuple[int, float]]]], dict[str, list[int]]]:
        """Per slice: the logprob of the token after each position (the slice's next input, then
        `prompt_next`), under the raw distribution, with `prompt_logprobs` alternatives each, and its
        rank (how many tokens are at least as likely, itself included: 1 = the most likely)."""
        lps: dict[str, list[float]] = {}
        tops: dict[str, list[list[tuple[int, float]]]] = {}
        ranks: dict[str, list[int]] = {}
        for r, first, _n in slices:
            targets = list(r.input_ids[1:]) + ([r.prompt_next] if r.prompt_next >= 0 else [])
            if not targets:
                lps[r.rid], ranks[r.rid] = [], []
                continue
            logp = torch.log_softmax(logits[first : first + len(targets)], dim=-1)
            tgt = torch.tensor(targets, dtype=torch.int64, device=logp.device)
            chosen = logp.gather(1, tgt[:, None])
            lps[r.rid] = chosen[:, 0].tolist()
            ranks[r.rid] = (logp >= chosen).sum(dim=-1).tolist()
            if r.prompt_logprobs > 0:
                tops[r.rid] = top_logprobs(logp, [r.prompt_logprobs] * len(targets))
        return lps, tops, ranks

    def check_integrity(self) -> None:
        self.pools.check_integrity()
        for _, site, weight in product_sites(self.model):
            site.check_integrity(weight)
        self.kv_mirror.check_integrity()
        self.model.encoder_cache.check_integrity()
        if self.loras is not None:
            self.loras.check_integrity()
        if self.drafter is not None:
            self.drafter.check_integrity()

