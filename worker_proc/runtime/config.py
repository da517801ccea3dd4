"""`WorkerConfig`: everything a worker rank's `ModelRunner` is built from besides the checkpoint and the
process group, validated once at construction.

The worker process makes it from the server's flags (`WorkerConfig.from_server_args`); tests and
benchmarks make it directly. Defaults are `ServerArgs`' where the flag exists; 0 for a pool size means
"planned from the memory budget".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.config import ServerArgs


@dataclass(frozen=True)
class WorkerConfig:
    """A rank's runtime settings (see the module doc); each field names the flag it comes from."""

    device: str = "cpu"
    dtype: str = "auto"  # --dtype
    state_dtype: str = "float32"  # --mamba-ssm-dtype
    kv_slots: int = 0  # --max-total-tokens (0: planned)
    state_slots: int = 0  # --max-mamba-cache-size (0: planned)
    mem_budget_bytes: int = 0  # --mem-budget-gb (0: the device's default)
    mem_fraction_static: float = 0.85  # --mem-fraction-static
    running_requests: int = 0  # --max-running-requests (sizes the CPU pools' wanted budget)
    state_ratio: float = 0.5  # --mamba-full-memory-ratio
    seed: int = 0  # --random-seed
    tp_rank: int = 0
    tp_size: int = 1  # --tp-size
    deterministic: bool = False  # --enable-deterministic-inference
    kernels: str = "auto"  # --kernels
    thread_options: tuple[int, ...] = ()  # the thread counts a step may run on (worker_proc.host.threads)
    execution_plan: str = ""  # --execution-plan (a pinned plan file)
    single_weight_copy: bool = False  # --single-weight-copy
    plan_cache_dir: Path | None = None  # --execution-plan-cache (None: no cache)
    quantization: str = ""  # --quantization
    quantize_lm_head: bool = True  # not --disable-lm-head-quantization
    speculative_algorithm: str = ""  # --speculative-algorithm
    enforce_eager: bool = False  # --enforce-eager (no step replay)
    encoder_cache_bytes: int = 256 << 20  # the vision tower's outputs kept by image digest (model.encoder_cache)
    max_loras: int = 0  # --max-loras-per-batch: adapter slots 1..max_loras (0: LoRA off, worker_proc.lora)
    max_lora_rank: int = 64  # --max-lora-rank: the largest adapter rank a slot takes

    def __post_init__(self) -> None:
        """The dtypes are the loader's and the pools' to check (against the checkpoint and the device)."""
        problems = []
        counts = ("kv_slots", "state_slots", "mem_budget_bytes", "running_requests", "seed", "encoder_cache_bytes",
                  "max_loras")
        problems += [f"{name} {getattr(self, name)} < 0" for name in counts if getattr(self, name) < 0]
        if not 0.0 < self.mem_fraction_static <= 1.0 or not 0.0 < self.state_ratio < 1.0:
            problems.append(f"fractions out of range (mem_fraction_static {self.mem_fraction_static}, "
                            f"state_ratio {self.state_ratio})")
        if not 0 <= self.tp_rank < self.tp_size:
            problems.append(f"tp_rank {self.tp_rank} of tp_size {self.tp_size}")
        if any(n < 1 for n in self.thread_options):
            problems.append(f"thread options {self.thread_options}")
        if self.max_loras and self.max_lora_rank < 1:
            problems.append(f"max_lora_rank {self.max_lora_rank} < 1 with {self.max_loras} adapter slots")
        if problems:
            raise ValueError("bad worker config: " + "; ".join(problems))

    @classmethod
    def from_server_args(cls, args: ServerArgs, *, device: str, rank: int, thread_options: tuple[int, ...],
                         plan_cache_dir: Path | None) -> WorkerConfig:
        """Rank `rank`'s config from the server's flags and what the host setup decided."""
        return cls(
            device=device, dtype=args.dtype, state_dtype=args.mamba_ssm_dtype, kv_slots=args.max_total_tokens,
            state_slots=args.max_mamba_cache_size, mem_budget_bytes=int(args.mem_budget_gb * (1 << 30)),
            mem_fraction_static=args.mem_fraction_static, running_requests=args.max_running_requests,
            state_ratio=args.mamba_full_memory_ratio, seed=args.random_seed, tp_rank=rank, tp_size=args.tp_size,
            deterministic=args.enable_deterministic_inference, kernels=args.kernels, thread_options=thread_options,
            execution_plan=args.execution_plan, single_weight_copy=args.single_weight_copy,
            plan_cache_dir=plan_cache_dir, quantization=args.quantization,
            quantize_lm_head=not args.disable_lm_head_quantization,
            speculative_algorithm=args.speculative_algorithm, enforce_eager=args.enforce_eager,
            encoder_cache_bytes=int(args.mm_encoder_cache_gb * (1 << 30)),
            max_loras=args.max_loras_per_batch if args.enable_lora else 0, max_lora_rank=args.max_lora_rank,
        )
