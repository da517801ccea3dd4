"""The command line of a launch (`hyssm-launch`, `python launch.py`, `hyssm serve`): its flags and how
they become the frozen `ServerArgs` every process gets.

What must hold: the flags mirror the fields of `ServerArgs` (SGLang's names where they exist), their
defaults are its defaults, and a field the launcher sets itself (`run_dir`, `dp_rank`, `http_uds`) is
no flag; fault injection (`FaultConfig`) comes from hidden `--fault-*` flags or `HYSSM_FAULTS`
(`name=value,...`). A bad flag ends the program with one line on stderr and exit code 2 (no usage
dump); a bad value is ServerArgs' ConfigError (or ValueError, TypeError), for the caller to report.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Literal, get_args, get_origin, get_type_hints

from shared.config import ConfigError, FaultConfig, ServerArgs

logger = logging.getLogger(__name__)

_HELP = {
    "model_path": "checkpoint directory (config.json + *.safetensors), or a Hugging Face Hub id (org/name, fetched "
    "before any process starts; HF_HUB_OFFLINE=1: the local cache only); 'builtin' = the shipped tiny model",
    "revision": "with a Hub id: the branch, tag or commit to fetch (default: main)",
    "download_dir": "with a Hub id: the Hub cache directory to fetch into (default: huggingface_hub's, "
    "HF_HUB_CACHE or HF_HOME/hub)",
    "max_total_tokens": "KV token slots per rank (0 = from the memory budget)",
    "max_mamba_cache_size": ("recurrent-state slots per rank: one holds every Mamba and Gated DeltaNet state of a "
                             "request (0 = from the memory budget)"),
    "mem_budget_gb": "memory for KV + state pools per rank in GiB, on any device (0 = the device default: "
    "--mem-fraction-static on CUDA, 0.25 GiB on CPU)",
    "mem_fraction_static": "CUDA: the share of each GPU's total memory the weights and the KV + state pools may "
    "take, the pools getting what the loaded weights leave of it (default: 0.85; --mem-budget-gb overrides)",
    "mamba_ssm_dtype": "storage of the recurrent states (Mamba SSM, Gated DeltaNet): float32, bfloat16, or int8 "
    "with a float32 scale per row of each head's state; updates are computed in float32 (default: float32)",
    "kernels": "kernel implementation: auto (Triton on CUDA, the fused native kernels on CPU, else fast), "
               "reference, fast, native, triton",
    "disable_prompt_checkpoint": "do not save each prompt's final Mamba state in the cache (a later request that "
    "extends or repeats the prompt then recomputes it)",
    "state_cache_dir": "a folder for the state store under the prefix cache: prefixes evicted from memory, or left by "
    "an earlier run or another server sharing the folder, are loaded from it instead of prefilled (default: none)",
    "hicache_storage_backend": "where the state store lives: file (--state-cache-dir) or mooncake (a Mooncake Store: "
    "give its master with --hicache-storage-backend-extra-config)",
    "hicache_storage_backend_extra_config": "JSON for the backend; mooncake: "
    "{\"master_server_address\": \"HOST:PORT\"} and optionally local_hostname (an address other hosts reach), "
    "protocol (tcp), local_buffer_size (bytes, more than the largest entry), global_segment_size (bytes this server "
    "lends the store; 0: a standalone mooncake_client holds it)",
    "hicache_size": "GiB of host memory in front of the state store (SGLang's flag): entries are written through it "
    "and read from it first, so a prefix evicted from GPU pools comes back without the disk or the network (on CPU "
    "the pools are host memory already; default 0: none)",
    "state_cache_size_gb": "GiB this server keeps in the state store at most (least recently used entries go first)",
    "hicache_write_policy": "write_through: a prefix's blocks and state are stored as soon as its prefill computed "
    "them (they survive a crash); write_back: when the cache evicts them, and everything at a graceful shutdown",
    "state_cache_block_tokens": "tokens per stored block: a prefix is stored and found in whole blocks, and a stored "
    "state resumes at a block's end",
    "state_cache_write_queue_mb": "MiB of writes that may wait for the store; a write beyond it is dropped (counted)",
    "cpu_threads": "torch threads per worker rank on CPU (0 = the execution plan measures, per step size, one "
    "thread against the rank's share of the node's cores)",
    "execution_plan": "run this execution plan file (a measured plan the log names, possibly edited) instead of "
    "measuring one at start-up; refused when it lacks a rule for one of the model's product shapes",
    "execution_plan_cache": "directory of measured execution plans, keyed by CPU, cores, torch version and the "
    "model's shapes ('' = $XDG_CACHE_HOME/hyssm/execution-plans, 'none' = measure on every start)",
    "enable_deterministic_inference": "batch-invariant numerics: a request's output does not depend on what it is "
    "batched with, whether its prefix came from the cache, or the TP size (slower on CPU)",
    "limit_mm_per_prompt": "vLLM's flag, JSON: the most images one prompt may carry, e.g. '{\"image\": 4}' "
    "(more is a 400; video and audio are not served, only 0 is accepted for them) (default: {\"image\": 8})",
    "mm_processor_kwargs": "vLLM's flag, JSON object: overrides given to the checkpoint's image processor when "
    "it is loaded, e.g. '{\"max_pixels\": 1003520, \"min_pixels\": 3136}' (default: none)",
    "media_fetch_timeout": "seconds an http(s) image URL may take to deliver its whole body; slower is a 400 "
    "(default: 5)",
    "max_image_bytes": "an image's encoded size at most, fetched or sent as base64; larger is a 400 (default: "
    "20971520, 20 MiB)",
    "allowed_media_domains": "vLLM's flag, comma-separated host names: image URLs (and their redirects) must name "
    "one of them, else a 400 before anything is fetched (default: any host)",
    "max_image_pixels": "an image's decoded width x height at most, checked before it is decoded; larger is a 400 "
    "(default: 50000000)",
    "mm_processor_cache_gb": "vLLM's flag: GiB of processed images the tokenizer process keeps by their encoded "
    "bytes, so an image sent again is not decoded and processed again (0 = keep none) (default: 0.5)",
    "mm_encoder_cache_gb": "GiB of the vision tower's outputs each worker rank keeps by image content, so that an "
    "image seen again is not encoded again (least recently used dropped; 0 = keep none) (default: 0.25)",
    "max_connections": "open HTTP connections at most; more are answered 503 and closed (default: 4096)",
    "chat_template": "the chat template: a Jinja file, or the name of one of the checkpoint's named templates "
    "(default: the checkpoint's own)",
    "tool_call_parser": "the format tool calls are read in with tool_choice auto: hermes / qwen25 (<tool_call> "
    "JSON), qwen3_coder (<tool_call><function=...> XML), granite (<|tool_call|>), nemotron (<TOOLCALL>), or "
    "auto: any of them (default)",
    "enable_auto_tool_choice": "accepted for vLLM command lines: tool_choice auto is always served here "
    "(read with --tool-call-parser), as SGLang does",
    "reasoning_parser": "qwen3 | deepseek-r1 | nemotron: return the <think> part of the output as "
    "reasoning_content (default: none, it stays in content)",
    "trust_request_chat_template": "render a chat request's own chat_template field (Jinja, sandboxed); without "
    "this flag such a request is a 400 naming the field, as vLLM does",
    "max_stored_responses": "Responses API objects kept in memory for previous_response_id and GET "
    "/v1/responses/{id}; the least recently used is dropped first (default: 1024)",
    "max_stored_responses_bytes": "the stored Responses API objects' size in all (each measured as its JSON); "
    "the least recently used are dropped until it holds, and one larger by itself is not stored (default: "
    "268435456, 256 MiB)",
    "http_read_timeout": "seconds from a request's first byte until its head and body are in (default: 30)",
    "dp_size": "data-parallel engine replicas on this node, each a scheduler with its own --tp-size ranks, "
    "behind the one HTTP server (requests are routed by cached prefix, then load: tokenizer_proc/replicas/routing.py)",
    "quantization": "quantize the weights at load: int8 (per-channel, W8A16 or W8A8, whichever this machine "
    "runs faster), int4 (group-wise W4A16, CPU), fp8 (e4m3, per-channel); default: as the checkpoint is stored",
    "disable_lm_head_quantization": "with --quantization, keep the LM head (and a tied embedding) in the model dtype",
    "single_weight_copy": "CPU: the measured execution plan keeps one layout of every weight (as stored, "
    "oneDNN's packed one or the tiled one: whichever its products lose least with) instead of the two or three "
    "its fastest products read where they fit in 1/16 of host memory; less memory, slower products at some "
    "row counts",
    "enforce_eager": "run every step's forward through the model's Python, as vLLM's flag does; by default a "
    "CPU decode step replays, in one native call, the calls its batch shape made in two steps that agreed "
    "(worker_proc/runtime/step_replay.py; TP size 1, native kernels)",
    "speculative_algorithm": "NGRAM: draft tokens from the request's own prompt and output (prompt lookup); "
    "NEXTN: draft them with the checkpoint's MTP layers (Qwen3-Next, Qwen3.5); either way they are verified in "
    "one step and the recurrent state is rolled back to the last accepted token (default: off)",
    "speculative_num_draft_tokens": "tokens drafted per request and step with --speculative-algorithm (default: 4)",
    "speculative_ngram_min_match_window_size": "NGRAM: the shortest suffix of the request's tokens that must "
    "match earlier in its tokens to draft what followed there (default: 1)",
    "speculative_ngram_max_match_window_size": "NGRAM: the longest suffix matched; the longest match wins, the "
    "most recent among equals (default: 12)",
    "enable_lora": "serve LoRA adapters (PEFT adapter directories) beside the base model: a request picks one by "
    "`model` (OpenAI routes) or `lora_path` (/generate); POST /load_lora_adapter and /unload_lora_adapter change "
    "the set at run time (--lora-paths implies this flag)",
    "lora_paths": "adapters loaded at start: NAME=PATH, or PATH (named after its directory), several after one "
    "flag (default: none)",
    "max_loras_per_batch": "adapter slots: the most distinct adapters running at once; a request whose adapter "
    "finds no slot waits like one refused for memory (default: 8)",
    "max_lora_rank": "the largest adapter rank accepted; a higher one is refused when it is loaded (default: 64)",
    "http_keep_alive_timeout": "seconds an HTTP connection may be idle before or between requests (default: 30)",
    "max_queued_requests": "generation requests (each choice of n counted) admitted per replica beyond "
    "--max-running-requests; past that a new one is answered 503 with Retry-After before its response starts. "
    "The default 256 is 4 x the default --max-running-requests: a queue that drains within a few generations' "
    "time, which a client can wait out, instead of one that grows until clients time out (default: 256)",
    "graceful_shutdown_timeout": "on SIGTERM, seconds in-flight requests get to finish while new ones get 503 and "
    "/health answers 503 'draining'; then the rest are aborted and every process exits 0; a second SIGTERM stops "
    "at once. 25 s lets a typical generation finish and stays under Kubernetes' default 30-s termination grace "
    "(default: 25)",
}


class _OneLineParser(argparse.ArgumentParser):
    """Bad flags end with one line on stderr (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """Flags mirror ServerArgs fields (SGLang names where they exist); defaults come from it."""
    parser = _OneLineParser(prog="hyssm-launch", description="Serve a hybrid SSM model.")
    hints = get_type_hints(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.name in ("faults", "run_dir", "dp_rank", "http_uds"):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        help_text = _HELP.get(f.name) or f"(default: {default!r})"
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", default=default, help=help_text)
        elif isinstance(default, tuple):  # several values after one flag, as SGLang's nargs="*"
            parser.add_argument(flag, nargs="*", default=default, help=help_text)
        elif get_origin(hints[f.name]) is Literal:
            parser.add_argument(flag, choices=get_args(hints[f.name]), default=default, help=help_text)
        else:
            parser.add_argument(flag, type=type(default), default=default, help=help_text)
    for f in dataclasses.fields(FaultConfig):
        flag = "--fault-" + f.name.replace("_", "-")
        parser.add_argument(flag, type=type(f.default), default=f.default, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = vars(build_parser().parse_args(argv))
    fault_kwargs = {k.removeprefix("fault_"): ns.pop(k) for k in list(ns) if k.startswith("fault_")}
    env_faults = os.environ.get("HYSSM_FAULTS")
    if env_faults:
        for item in env_faults.split(","):
            key, _, value = item.partition("=")
            default = getattr(FaultConfig, key.strip(), None)
            if default is None and key.strip() not in FaultConfig.__dataclass_fields__:
                raise ConfigError(f"HYSSM_FAULTS: unknown fault {key!r}")
            kind = type(FaultConfig.__dataclass_fields__[key.strip()].default)
            fault_kwargs[key.strip()] = kind(value)
    ns = {k: tuple(v) if isinstance(v, list) else v for k, v in ns.items()}
    return ServerArgs(**ns, faults=FaultConfig(**fault_kwargs))
