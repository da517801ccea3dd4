"""Frozen server configuration shared by every process.

`ServerArgs` is built once by `launch.py` from the command line, validated at construction,
and handed (msgspec-encoded) to every child process. Nothing mutates it afterwards; the CLI
reads its defaults from the field defaults here so there is one source of truth.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

import msgspec

StateDtype = Literal["float32", "bfloat16", "int8"]
"""`--mamba-ssm-dtype`: the storage of the Mamba SSM and Gated DeltaNet recurrent states (computed in float32)."""

BUILTIN_MODEL = "builtin"
"""`--model-path` value that selects the tiny checkpoint shipped inside `worker_proc`."""


class ConfigError(ValueError):
    """An invalid flag value or combination; the message is one line naming the flag."""


def builtin_model_dir() -> str:
    """Directory of the checkpoint shipped with the package (config.json + safetensors + tokenizer)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(here), "worker_proc", "builtin_model")


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests. Off by default; only reachable through `--fault-*` CLI flags
    or the HYSSM_FAULTS environment variable, never through the HTTP API."""

    refuse_cow_fraction: float = 0.0  # workers refuse this fraction of copy-on-write ops
    raise_at_step: int = -1  # worker raises inside this step number
    delay_step_s: float = 0.0  # worker sleeps this long in every step (simulated slow device)
    delay_start_s: float = 0.0  # worker ranks sleep this long while loading (a simulated slow first start)
    crash_process: str = ""  # a ServerArgs.proc_name: "tokenizer" | "scheduler" | "worker-tp<N>" | ...
    crash_at_step: int = -1  # step at which crash_process exits abruptly
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.refuse_cow_fraction <= 1.0:
            raise ConfigError("--fault-refuse-cow-fraction must be in [0, 1]")
        if self.delay_step_s < 0 or self.delay_start_s < 0:
            raise ConfigError("--fault-delay-step-s and --fault-delay-start-s must be >= 0")


@dataclass(frozen=True)
class ServerArgs:
    """Every flag of `launch.py`. Validated in `__post_init__`; raise ConfigError on bad values."""

    model_path: str = BUILTIN_MODEL  # a directory, or a Hub id the launcher resolves to one (shared/hub.py)
    revision: str = ""  # a Hub id's branch, tag or commit ("" = main)
    download_dir: str = ""  # the Hub cache a Hub id is fetched into ("" = huggingface_hub's own)
    served_model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 30000
    http_uds: str = ""  # the tokenizer serves HTTP on this unix socket instead of host:port (hyssm.Engine sets it)
    api_key: str = ""
    tp_size: int = 1
    dp_size: int = 1  # engine replicas (each a scheduler with its own TP ranks) behind one tokenizer
    dp_rank: int = 0  # which replica a scheduler or worker process belongs to; launch.py fills it in
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    base_gpu_id: int = 0
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    mamba_ssm_dtype: StateDtype = "float32"  # how recurrent states are stored (worker_proc/kernels/state_codec.py)
    kernels: Literal["auto", "reference", "fast", "native", "triton"] = "auto"
    quantization: Literal["", "int8", "int4", "fp8"] = ""  # weights quantized at load (worker_proc/loading/quantize.py)
    disable_lm_head_quantization: bool = False  # with --quantization, the LM head stays in the model dtype
    enable_deterministic_inference: bool = False
    cpu_threads: int = 0  # torch threads per worker rank on CPU; 0 = measured per step size within the share
    execution_plan: str = ""  # a plan file to run instead of measuring one (worker_proc/plan/source.py)
    single_weight_copy: bool = False  # the measured plan keeps one layout of every weight (less memory)
    enforce_eager: bool = False  # every step runs the model's Python; no recorded decode step is replayed
    execution_plan_cache: str = ""  # where measured plans are kept; "" = $XDG_CACHE_HOME/hyssm; "none" = nowhere
    random_seed: int = 0
    log_level: str = "info"
    # capacities (0 = derive from the memory budget)
    max_running_requests: int = 64
    max_total_tokens: int = 0
    max_mamba_cache_size: int = 0
    mem_budget_gb: float = 0.0  # 0 = the device's default (below; worker_proc/state/pools.py pool_budget)
    mem_fraction_static: float = 0.85  # CUDA: weights + pools take at most this share of the device
    mamba_full_memory_ratio: float = 0.5
    # scheduling
    chunked_prefill_size: int = 512
    max_prefill_tokens: int = 2048
    disable_radix_cache: bool = False
    schedule_policy: Literal["fcfs", "priority"] = "fcfs"
    enable_priority_preemption: bool = False
    mamba_checkpoint_interval: int = 0  # 0 = only branch-point (and prompt-end) checkpoints
    # LoRA adapters (SGLang's flags; --lora-paths implies --enable-lora, as SGLang does)
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()  # NAME=PATH, or PATH (named after its directory); normalised to NAME=PATH
    max_loras_per_batch: int = 8  # adapter slots: distinct adapters that run in one batch at most
    max_lora_rank: int = 64  # the largest adapter rank accepted (the workers size their adapter buffers by it)
    # speculative decoding (scheduler_proc/drafting.py drafts, worker_proc/spec/verify.py verifies)
    speculative_algorithm: Literal["", "NGRAM", "NEXTN"] = ""
    speculative_num_draft_tokens: int = 4  # drafted tokens verified per step (K)
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    disable_prompt_checkpoint: bool = False  # no state checkpoint at the end of each prompt
    # the state store under the radix cache (docs/architecture.md, "State store")
    state_cache_dir: str = ""  # a folder (any shared filesystem too) for stored prefixes; "" = no store
    hicache_storage_backend: Literal["file", "mooncake"] = "file"  # SGLang's flag; file = --state-cache-dir
    hicache_storage_backend_extra_config: str = ""  # SGLang's flag: JSON; mooncake: {"master_server_address": ...}
    state_cache_size_gb: float = 16.0  # what one server keeps in it at most
    hicache_size: float = 0.0  # SGLang's flag: GiB of host memory in front of the store (0: none; for CUDA pools)
    hicache_write_policy: Literal["write_through", "write_back"] = "write_through"  # SGLang's flag
    state_cache_block_tokens: int = 64  # tokens per stored block; a stored state resumes at a block's end
    state_cache_write_queue_mb: int = 512  # writes waiting for the store; a write past it is dropped
    # chat (tokenizer process)
    chat_template: str = ""  # a template file, or the name of one of the checkpoint's named templates
    tool_call_parser: Literal["auto", "hermes", "qwen25", "granite", "nemotron", "qwen3_coder"] = "auto"
    enable_auto_tool_choice: bool = False  # vLLM's flag: tool_choice "auto" is always parsed here, as SGLang does
    reasoning_parser: Literal["", "qwen3", "deepseek-r1", "nemotron"] = ""
    trust_request_chat_template: bool = False  # vLLM's flag: a request's own chat_template is rendered
    # limits
    context_length: int = 0  # 0 = the model's max_position_embeddings
    max_new_tokens_limit: int = 4096
    max_body_bytes: int = 32 * 1024 * 1024  # room for an image of --max-image-bytes sent as base64
    # image inputs of a checkpoint that sees (tokenizer process: tokenizer_proc/requests/images.py)
    limit_mm_per_prompt: str = '{"image": 8}'  # vLLM's flag: JSON, the most items of each modality per prompt
    mm_processor_kwargs: str = ""  # vLLM's flag: JSON object of overrides given to the image processor
    media_fetch_timeout: float = 5.0  # seconds an image URL may take to answer with its whole body
    max_image_bytes: int = 20 * 1024 * 1024  # an image's encoded size (fetched, or decoded from base64)
    max_image_pixels: int = 50_000_000  # an image's decoded width x height
    allowed_media_domains: str = ""  # vLLM's flag: comma-separated hosts image URLs may name ("" = any)
    mm_processor_cache_gb: float = 0.5  # vLLM's flag: processed images kept by their encoded bytes (tokenizer)
    mm_encoder_cache_gb: float = 0.25  # each worker rank: the vision tower's outputs kept by image digest
    # HTTP connections (tokenizer process)
    max_connections: int = 4096  # open connections; more are answered 503 and closed
    max_stored_responses: int = 1024  # Responses API objects kept for previous_response_id (least recent dropped)
    max_stored_responses_bytes: int = 256 * 1024 * 1024  # and their size in all (requests/response_store.py)
    http_read_timeout: float = 30.0  # seconds from a request's first byte until its body is in
    http_keep_alive_timeout: float = 30.0  # seconds a connection may sit idle between requests
    # backpressure and shutdown (tokenizer process: tokenizer_proc/admission.py)
    max_queued_requests: int = 256  # per replica, admitted beyond --max-running-requests; more get 503
    graceful_shutdown_timeout: float = 25.0  # SIGTERM: seconds in-flight requests get to finish
    # supervision
    watchdog_timeout: float = 300.0  # SGLang's default: a long CPU prefill step must not count as a hang
    startup_timeout: float = 120.0
    run_dir: str = ""  # where ipc:// endpoints live; launch.py fills it in
    faults: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        positive = {
            "--port": self.port,
            "--tp-size": self.tp_size,
            "--dp-size": self.dp_size,
            "--nnodes": self.nnodes,
            "--max-running-requests": self.max_running_requests,
            "--chunked-prefill-size": self.chunked_prefill_size,
            "--max-prefill-tokens": self.max_prefill_tokens,
            "--max-new-tokens-limit": self.max_new_tokens_limit,
            "--max-body-bytes": self.max_body_bytes,
            "--max-image-bytes": self.max_image_bytes,
            "--max-image-pixels": self.max_image_pixels,
            "--max-connections": self.max_connections,
            "--max-stored-responses": self.max_stored_responses,
            "--max-stored-responses-bytes": self.max_stored_responses_bytes,
            "--state-cache-block-tokens": self.state_cache_block_tokens,
            "--state-cache-write-queue-mb": self.state_cache_write_queue_mb,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{flag} must be a positive integer, got {value}")
        if self.port > 65535:
            raise ConfigError(f"--port must be at most 65535, got {self.port}")
        non_negative = {
            "--max-total-tokens": self.max_total_tokens,
            "--max-mamba-cache-size": self.max_mamba_cache_size,
            "--base-gpu-id": self.base_gpu_id,
            "--mamba-checkpoint-interval": self.mamba_checkpoint_interval,
            "--context-length": self.context_length,
            "--mem-budget-gb": self.mem_budget_gb,
            "--mm-encoder-cache-gb": self.mm_encoder_cache_gb,
            "--mm-processor-cache-gb": self.mm_processor_cache_gb,
            "--cpu-threads": self.cpu_threads,
            "--max-queued-requests": self.max_queued_requests,
            "--graceful-shutdown-timeout": self.graceful_shutdown_timeout,
        }
        for flag, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"{flag} must be >= 0, got {value}")
        if self.speculative_algorithm and not 1 <= self.speculative_num_draft_tokens <= 16:
            raise ConfigError(
                f"--speculative-num-draft-tokens must be in [1, 16], got {self.speculative_num_draft_tokens}"
            )
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ConfigError(f"--speculative-ngram-min/max-match-window-size must be 1 <= min <= max, got {lo}, {hi}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ConfigError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        if not 0.0 < self.mamba_full_memory_ratio < 1.0:
            raise ConfigError("--mamba-full-memory-ratio must be in (0, 1)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ConfigError(f"dp_rank must be in [0, {self.dp_size}), got {self.dp_rank}")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ConfigError("--dp-size > 1 runs on one node; across nodes run one server per node behind a router")
        if self.tp_size % self.nnodes != 0:
            raise ConfigError(f"--tp-size {self.tp_size} must be divisible by --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("--dist-init-addr HOST:PORT is required when --nnodes > 1")
        if self.dist_init_addr and not _valid_host_port(self.dist_init_addr):
            raise ConfigError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.max_prefill_tokens < self.chunked_prefill_size:
            raise ConfigError("--max-prefill-tokens must be >= --chunked-prefill-size")
        if self.http_read_timeout <= 0 or self.http_keep_alive_timeout <= 0:
            raise ConfigError("--http-read-timeout and --http-keep-alive-timeout must be positive")
        if any(not d.strip() or "/" in d for d in self.allowed_media_domains.split(",")) and self.allowed_media_domains:
            raise ConfigError(f"--allowed-media-domains must be comma-separated host names, got "
                              f"{self.allowed_media_domains!r}")
        if self.media_fetch_timeout <= 0:
            raise ConfigError(f"--media-fetch-timeout must be positive, got {self.media_fetch_timeout}")
        self.image_limit()  # raises ConfigError on a bad value
        self._check_lora()
        self.image_processor_kwargs()
        if self.watchdog_timeout <= 0 or self.startup_timeout <= 0:
            raise ConfigError("--watchdog-timeout and --startup-timeout must be positive")
        if self.quantization == "int4" and self.device == "cuda":
            raise ConfigError("--quantization int4 runs on the CPU only (torch's CPU 4-bit kernel); use int8 or fp8")
        if self.mamba_ssm_dtype not in get_args(StateDtype):
            raise ConfigError(
                f"--mamba-ssm-dtype must be {'|'.join(get_args(StateDtype))}, got {self.mamba_ssm_dtype!r}"
            )
        if self.state_cache_size_gb <= 0:
            raise ConfigError(f"--state-cache-size-gb must be positive, got {self.state_cache_size_gb}")
        self.store_extra_config()  # raises ConfigError on a bad value
        if self.hicache_size < 0:
            raise ConfigError(f"--hicache-size must be >= 0, got {self.hicache_size}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ConfigError(f"--log-level must be debug|info|warning|error|critical, got {self.log_level}")

    def _check_lora(self) -> None:
        """--lora-paths implies --enable-lora and is normalised to NAME=PATH entries with unique names; the
        adapter limits must be positive (they are checked, like SGLang's, even while LoRA is off)."""
        if self.max_loras_per_batch <= 0:
            raise ConfigError(f"--max-loras-per-batch must be a positive integer, got {self.max_loras_per_batch}")
        if self.max_lora_rank <= 0:
            raise ConfigError(f"--max-lora-rank must be a positive integer, got {self.max_lora_rank}")
        paths = tuple(self.lora_paths)
        named = tuple(f"{name}={path}" for name, path in (parse_lora_path(p) for p in paths))
        names = [n.partition("=")[0] for n in named]
        if dup := next((n for n in names if names.count(n) > 1), None):
            raise ConfigError(f"--lora-paths names the adapter {dup!r} twice")
        object.__setattr__(self, "lora_paths", named)
        if named and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)

    def lora_path_map(self) -> dict[str, str]:
        """--lora-paths as {name: path}, in the order given."""
        return dict(parse_lora_path(p) for p in self.lora_paths)

    # ---- derived values -------------------------------------------------------------------
    @property
    def state_store_enabled(self) -> bool:
        return bool(self.state_cache_dir) or self.hicache_storage_backend == "mooncake"

    def store_extra_config(self) -> dict[str, str | int]:
        """--hicache-storage-backend-extra-config as a dict, checked for the backend (ConfigError)."""
        extra = json_object_flag("--hicache-storage-backend-extra-config", self.hicache_storage_backend_extra_config,
                                 '{"master_server_address": "HOST:PORT"}')
        allowed = MOONCAKE_EXTRA_KEYS if self.hicache_storage_backend == "mooncake" else {}
        for name, value in extra.items():
            if name not in allowed:
                known = ", ".join(sorted(allowed)) or "none"
                raise ConfigError(f"--hicache-storage-backend-extra-config: unknown key {name!r} for the "
                                  f"{self.hicache_storage_backend} backend (known: {known})")
            if not isinstance(value, allowed[name]) or isinstance(value, bool):
                raise ConfigError(f"--hicache-storage-backend-extra-config: {name} must be a {allowed[name].__name__}")
        if self.hicache_storage_backend == "mooncake" and not extra.get("master_server_address"):
            raise ConfigError("--hicache-storage-backend mooncake needs --hicache-storage-backend-extra-config "
                              "'{\"master_server_address\": \"HOST:PORT\"}'")
        return extra

    def media_domains(self) -> frozenset[str]:
        """The hosts image URLs may name (--allowed-media-domains, lower case); empty: any."""
        return frozenset(d.strip().lower() for d in self.allowed_media_domains.split(",") if d.strip())

    def image_limit(self) -> int:
        """The most images one prompt may carry (--limit-mm-per-prompt's "image"; ConfigError on a bad value).
        Other modalities are not served: they may be given only as 0."""
        limits = json_object_flag("--limit-mm-per-prompt", self.limit_mm_per_prompt, '{"image": 4}')
        for name, value in limits.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"--limit-mm-per-prompt: {name} must be an integer >= 0, got {value!r}")
            if name not in ("image", "video", "audio"):
                raise ConfigError(f"--limit-mm-per-prompt: unknown modality {name!r} (image, video, audio)")
            if name != "image" and value:
                raise ConfigError(f"--limit-mm-per-prompt: {name} input is not supported (only 0)")
        return int(limits.get("image", DEFAULT_IMAGES_PER_PROMPT))

    def image_processor_kwargs(self) -> dict[str, object]:
        """--mm-processor-kwargs as a dict (ConfigError unless a JSON object)."""
        return json_object_flag("--mm-processor-kwargs", self.mm_processor_kwargs, '{"max_pixels": 1003520}')

    @property
    def resolved_model_path(self) -> str:
        return builtin_model_dir() if self.model_path == BUILTIN_MODEL else self.model_path

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model_path == BUILTIN_MODEL:
            return "hyssm-tiny"
        return os.path.basename(os.path.normpath(self.model_path))

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def proc_name(self, kind: str, rank: int | None = None) -> str:
        """The name of a process of this launch (its title after `hyssm::`, its ProcReady name, the
        fault-injection target): "tokenizer", "scheduler", "worker-tp<R>"; with --dp-size > 1 the
        scheduler and workers of replica D are "scheduler-dp<D>" and "worker-dp<D>-tp<R>"."""
        replica = f"-dp{self.dp_rank}" if self.dp_size > 1 and kind != "tokenizer" else ""
        return f"{kind}{replica}" if rank is None else f"{kind}{replica}-tp{rank}"

    def local_ranks(self) -> range:
        start = self.node_rank * self.ranks_per_node
        return range(start, start + self.ranks_per_node)

    def replace(self, **changes: object) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def from_bytes(data: bytes) -> ServerArgs:
        return msgspec.msgpack.decode(data, type=ServerArgs)


DEFAULT_IMAGES_PER_PROMPT = 8
"""Images per prompt when --limit-mm-per-prompt does not name "image"."""

MOONCAKE_EXTRA_KEYS: dict[str, type] = {"master_server_address": str, "local_hostname": str, "protocol": str,
                                         "global_segment_size": int, "local_buffer_size": int}
"""What --hicache-storage-backend-extra-config may set for Mooncake (shared/state_store/mooncake.py)."""


LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
"""An adapter's name: what a request's `model` or `lora_path` gives (no `=`, no spaces, at most 128 characters)."""


def json_object_flag(flag: str, text: str, example: str) -> dict:
    """A flag's JSON object ({} for an empty value); ConfigError naming the flag, with `example`, otherwise."""
    try:
        value = json.loads(text) if text else {}
    except ValueError as e:
        raise ConfigError(f"{flag} is not JSON (e.g. '{example}'): {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object (e.g. '{example}')")
    return value


def parse_lora_path(entry: str) -> tuple[str, str]:
    """One --lora-paths value as (name, path): NAME=PATH, or a bare PATH named after its last directory
    (ConfigError on an empty or malformed one)."""
    name, sep, path = entry.partition("=")
    if not sep:
        path = entry
        name = os.path.basename(os.path.normpath(entry)) if entry.strip() else ""
    if not path.strip():
        raise ConfigError(f"--lora-paths: {entry!r} names no path (give NAME=PATH or PATH)")
    if not LORA_NAME.fullmatch(name):
        raise ConfigError(f"--lora-paths: {entry!r}: the adapter name {name!r} must be 1-128 letters, digits or "
                          "._:/- (starting with a letter or digit)")
    return name, path


def _valid_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
