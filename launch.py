"""hyssm launcher: parse flags, start every process, wait for readiness, supervise, tear down.

Node 0 runs the tokenizer (HTTP), the scheduler and its worker ranks (with --dp-size N: N
schedulers, each with its own ranks; shared/replicas.py); other nodes run only their worker ranks.
The launcher owns the children: it watches their sentinels, and when any of them dies it tells the
tokenizer (so in-flight requests get a final error and /health turns 503), stops the rest and exits
non-zero. With replicas, a death inside one replica stops only that replica while another is up
(the tokenizer is told, so only that replica's requests fail). SIGTERM/SIGINT shut down gracefully (exit 0),
whether they reach launch.py alone or the whole process group (see shared/proc.py): the tokenizer
drains first (up to --graceful-shutdown-timeout), then the schedulers and workers stop; a second
SIGTERM/SIGINT to launch.py kills every child at once (exit 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import wait
from typing import Any, Literal, get_args, get_origin, get_type_hints

import zmq

from shared.channels import SCHEDULER_TO_TOKENIZER, TO_LAUNCHER, ChannelTimeout, Receiver, Sender
from shared.child_process import ChildProcess
from shared.config import ConfigError, FaultConfig, ServerArgs
from shared.errors import HyssmError
from shared.hub import resolve_model
from shared.log import setup_logging
from shared.messages import ProcFailed, ProcReady, SchedulerDead
from shared.model_info import ModelInfo
from shared.proc import FORWARD_SIGNAL, STOP_SIGNAL
from shared.replicas import ReplicaSet, dist_addrs, node_processes
from shared.rundir import RunDir, remove_stale

logger = logging.getLogger("launch")

_STARTUP_MARGIN_S = 5.0
_TOKENIZER_CLOSE_S = 5.0  # after its drain: answer the last clients, close connections and channels

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
    "(worker_proc/step_replay.py; TP size 1, native kernels)",
    "speculative_algorithm": "NGRAM: draft tokens from the request's own prompt and output (prompt lookup); "
    "NEXTN: draft them with the checkpoint's MTP layers (Qwen3-Next, Qwen3.5); either way they are verified in "
    "one step and the recurrent state is rolled back to the last accepted token (default: off)",
    "speculative_num_draft_tokens": "tokens drafted per request and step with --speculative-algorithm (default: 4)",
    "speculative_ngram_min_match_window_size": "NGRAM: the shortest suffix of the request's tokens that must "
    "match earlier in its tokens to draft what followed there (default: 1)",
    "speculative_ngram_max_match_window_size": "NGRAM: the longest suffix matched; the longest match wins, the "
    "most recent among equals (default: 12)",
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
    return ServerArgs(**ns, faults=FaultConfig(**fault_kwargs))


def preflight(args: ServerArgs) -> ModelInfo:
    """Checks that fail fast with one line before any process starts."""
    info = ModelInfo.from_dir(args.resolved_model_path)
    _check_quantization(args)
    if args.tp_size > 1:
        _check_tp_layout(args)
    if args.speculative_algorithm == "NEXTN":
        _check_mtp_layers(args)
    if args.chat_template:
        _check_chat_template(args)
    if args.node_rank == 0 and not args.http_uds:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # as the tokenizer will bind: connections of a previous server in TIME_WAIT do not count,
            # a socket still listening there does (Linux refuses the bind)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((args.host, args.port))
            except OSError as e:
                raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from e
    if args.device == "cuda":
        import torch  # only for the GPU count; children import torch themselves

        n_gpus = torch.cuda.device_count()
        wanted = args.ranks_per_node * args.dp_size
        if args.device == "cuda" and n_gpus < args.base_gpu_id + wanted:
            raise ConfigError(
                f"--tp-size {args.tp_size} x --dp-size {args.dp_size} needs {wanted} GPUs from --base-gpu-id "
                f"{args.base_gpu_id} on this node, found {n_gpus}"
            )
    if args.node_rank > 0:
        _wait_for_node0(args)
    return info


def _check_quantization(args: ServerArgs) -> None:
    """A pre-quantized checkpoint's `quantization_config` is one the workers load, on this device, and
    `--quantization` (if given) names the format it is stored in."""
    from shared.model_info import read_config_json
    from worker_proc.prequant_config import check_requested, parse_quantization_config  # torch-free

    path = os.path.join(args.resolved_model_path, "config.json")
    quant = parse_quantization_config(read_config_json(args.resolved_model_path).get("quantization_config"), path)
    if quant is None:
        return
    check_requested(args.quantization, quant, path)
    if "int4" in quant.formats and args.device == "cuda":
        raise ConfigError(f"{path}: {quant.describe()}: 4-bit weights run on the CPU only (torch's CPU 4-bit kernel)")


def _check_tp_layout(args: ServerArgs) -> None:
    """The model's head counts (and MLP widths) must split evenly over --tp-size ranks."""
    from shared.families.registry import parse_config  # torch-free
    from shared.model_config import tp_layout_error
    from shared.model_info import read_config_json

    path = args.resolved_model_path
    cfg = parse_config(read_config_json(path), os.path.join(path, "config.json"))
    problem = tp_layout_error(cfg, args.tp_size)
    if problem:
        raise ConfigError(problem)


def _check_chat_template(args: ServerArgs) -> None:
    """--chat-template names a file or one of the checkpoint's named templates, and it compiles."""
    from tokenizer_proc.requests.chat_template import ChatTemplate, ChatTemplateError, select_template

    path = os.path.join(args.resolved_model_path, "tokenizer_config.json")
    config: dict = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    try:
        ChatTemplate(select_template(config, args.resolved_model_path, args.chat_template))
    except ChatTemplateError as e:
        raise ConfigError(str(e)) from e


def _check_mtp_layers(args: ServerArgs) -> None:
    """NEXTN drafts with the checkpoint's MTP layers: it must have some."""
    from shared.families.registry import parse_config  # torch-free
    from shared.model_info import read_config_json

    path = args.resolved_model_path
    cfg = parse_config(read_config_json(path), os.path.join(path, "config.json"))
    if not cfg.mtp_layers:
        raise ConfigError(f"--speculative-algorithm NEXTN: the {cfg.architecture} checkpoint {path} has no MTP layers "
                          "(mtp_num_hidden_layers or num_nextn_predict_layers in config.json); use NGRAM")


def _wait_for_node0(args: ServerArgs) -> None:
    """A node other than 0 starts nothing until node 0's rendezvous address (--dist-init-addr,
    served by rank 0) accepts connections, waiting at most --startup-timeout. Node 0 may well
    start later than this node, so refused connections are retried until the deadline."""
    host, _, port = args.dist_init_addr.rpartition(":")
    deadline = time.monotonic() + args.startup_timeout
    reason = ""
    try:
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=1.0):
                    return
            except OSError as e:
                reason = e.strerror or type(e).__name__
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"--dist-init-addr {args.dist_init_addr} unreachable for {args.startup_timeout:.0f}s "
                    f"({reason}): is node 0 running with the same address?"
                )
            time.sleep(0.25)  # retry interval of a poll on another machine, not synchronisation
    except KeyboardInterrupt:
        raise ConfigError(f"interrupted while waiting for node 0 at {args.dist_init_addr}") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """Owns every child process of this node and the run directory."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ctx = zmq.Context()
        self.procs: dict[str, ChildProcess] = {}
        self.ready_rx: Receiver = Receiver(self.ctx, TO_LAUNCHER, args)
        self.stop_requested = False
        self.direct_signals = 0  # SIGTERM/SIGINT sent to launch.py itself (not forwarded by a child)
        self.forced = False  # a second one came: every child was killed
        self.replicas = ReplicaSet([])

    def start(self, addrs: list[str]) -> None:
        """Start every child of this node (shared/replicas.py); `addrs`: each replica's rendezvous address."""
        specs = node_processes(self.args, addrs)
        self.replicas = ReplicaSet(specs)
        for spec in specs:
            self.procs[spec.name] = ChildProcess(spec.kind, spec.args.to_bytes(), spec.rank, spec.name)
        for proc in self.procs.values():
            proc.start()

    def wait_ready(self) -> dict[str, Any]:
        """Block until every child reported ProcReady; raise StartupError naming the laggard."""
        pending = set(self.procs)
        info: dict[str, Any] = {}
        # Children enforce the start-up timeout themselves and report what they miss (the scheduler
        # names absent ranks and nodes); the launcher's own deadline comes a little later.
        deadline = time.monotonic() + self.args.startup_timeout + _STARTUP_MARGIN_S
        while pending:
            if self.stop_requested:
                raise HyssmError("interrupted during start-up")
            dead = [n for n, p in self.procs.items() if not p.is_alive()]
            if dead:
                raise HyssmError(f"{dead[0]} exited during start-up (code {self.procs[dead[0]].exitcode})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise HyssmError(f"not ready within {self.args.startup_timeout:.0f}s: {', '.join(sorted(pending))}")
            try:
                msg = self.ready_rx.recv(int(min(left, 0.5) * 1000))
            except ChannelTimeout:
                continue
            if isinstance(msg, ProcFailed):
                raise HyssmError(f"{msg.name}: {msg.error}")
            if isinstance(msg, ProcReady):
                pending.discard(msg.name)
                info.update(msg.info)
        return info

    def supervise(self) -> int:
        """Wait until a child dies (exit 1) or a stop signal arrives (exit 0). With --dp-size > 1 a
        death inside one replica takes down only that replica while another one is up."""
        sentinels = {p.sentinel: name for name, p in self.procs.items()}
        while not self.stop_requested:
            done = wait(list(sentinels), timeout=0.5)
            if self.stop_requested:  # a group signal: children may stop as it arrives
                break
            if done:
                name = sentinels.pop(done[0])
                self.procs[name].join(5.0)  # the sentinel closes before the exit status can be read
                code = self.procs[name].exitcode
                if code == 0 and self.args.node_rank > 0:  # told to stop by node 0's scheduler
                    logger.info("%s stopped: node 0 shut down", name)
                    self.shutdown("")
                    return 0
                failure = f"{name} exited unexpectedly (code {code})"
                if not self.replicas.ends_launch(name):
                    for stopped in self._replica_down(name, failure):
                        sentinels.pop(self.procs[stopped].sentinel, None)
                    continue
                if self.args.dp_size > 1 and name != "tokenizer":
                    failure += "; no replica is left"
                logger.error("%s; shutting down", failure)
                self.shutdown(failure)
                return 1
            self._drain_reports()
        self.shutdown("")
        return 1 if self.forced else 0

    def _replica_down(self, name: str, failure: str) -> list[str]:
        """Take down the replica of `name`: tell the tokenizer (its requests there end with an error,
        new ones go to the replicas up), stop its other processes. Returns their names."""
        d, others = self.replicas.take_down(name, failure)
        logger.error("%s: replica %d is down, %d replica(s) still serving", failure, d, len(self.replicas.up))
        self._tell_tokenizer(self.replicas.args_of(d), failure)
        self._stop(others)
        return others

    def _tell_tokenizer(self, args: ServerArgs, failure: str) -> None:
        tok = self.procs.get("tokenizer")
        if tok is None or not tok.is_alive():
            return
        try:
            tx = Sender(self.ctx, SCHEDULER_TO_TOKENIZER, args)
            tx.send(SchedulerDead(reason=failure), 1000)
            tx.close(linger_ms=1000)
        except ChannelTimeout:
            pass

    def _grace(self, name: str) -> float:
        """Seconds a stopping child gets before SIGKILL: the tokenizer its drain and close; a worker
        with a state store its queued writes (--graceful-shutdown-timeout); any other 3 s."""
        if name == "tokenizer":
            return self.args.graceful_shutdown_timeout + _TOKENIZER_CLOSE_S
        if name.startswith("worker") and self.args.state_store_enabled:
            return self.args.graceful_shutdown_timeout
        return 3.0

    def _stop(self, names: list[str]) -> None:
        """Stop `names` in order (tokenizer with SIGTERM, others with STOP_SIGNAL); SIGKILL what is
        still alive after its grace period: the tokenizer's is its drain (--graceful-shutdown-timeout)
        plus _TOKENIZER_CLOSE_S to close its connections."""
        for name in names:
            proc = self.procs[name]
            if proc.is_alive():
                if name == "tokenizer":
                    proc.terminate()
                elif proc.pid is not None:
                    os.kill(proc.pid, STOP_SIGNAL)
                proc.join(self._grace(name))
        for name in names:
            if self.procs[name].is_alive():
                self.procs[name].kill()
                self.procs[name].join(2.0)

    def _drain_reports(self) -> None:
        for msg in self.ready_rx.drain(16):
            if isinstance(msg, ProcFailed):
                logger.error("%s reported: %s", msg.name, msg.error)

    def shutdown(self, failure: str) -> None:
        """Tell the tokenizer (on failure, for every replica still up), then stop children: tokenizer
        first so clients get their answers, then schedulers and workers. Bounded: SIGKILL after the
        grace period."""
        if failure:
            for d in self.replicas.up:
                self._tell_tokenizer(self.replicas.args_of(d), failure)
        kinds = ("tokenizer", "scheduler", "worker")
        self._stop([n for kind in kinds for n in self.procs if n.startswith(kind)])
        for proc in self.procs.values():
            if not proc.is_alive():
                proc.close()
        self.ready_rx.close()
        self.ctx.term()

    def request_stop(self, signum: int, _frame: object) -> None:
        """SIGTERM/SIGINT (or FORWARD_SIGNAL from a child): shut down gracefully. A second SIGTERM or
        SIGINT sent to launch.py itself kills every child at once (exit 1); a child's forwarded
        signal never counts as a second one (a group SIGTERM reaches launch.py that way too)."""
        name = signal.Signals(signum).name
        if signum != FORWARD_SIGNAL:
            self.direct_signals += 1  # counted apart: Python may run a pending forward's handler first
        if self.direct_signals >= 2:
            if not self.forced:
                logger.warning("received %s again: stopping every process now", name)
                self.forced = True
                for proc in self.procs.values():
                    if proc.is_alive():
                        proc.kill()
            return
        if not self.stop_requested:
            logger.info("received %s, shutting down (in-flight requests get up to %g s)", name,
                        self.args.graceful_shutdown_timeout)  # fmt: skip
        self.stop_requested = True


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except (ConfigError, ValueError, TypeError) as e:
        print(f"hyssm-launch: error: {e}", file=sys.stderr)
        return 2
    setup_logging(f"launch-node{args.node_rank}", args.log_level)
    try:
        args = resolve_model(args)  # a Hub id becomes its local snapshot: children only see directories
        preflight(args)
    except (ConfigError, HyssmError) as e:
        print(f"hyssm-launch: error: {e}", file=sys.stderr)
        return 2
    stale = remove_stale()
    if stale:
        logger.info("removed %d run directories left by launches that did not exit: %s", len(stale), stale)
    run = RunDir.create()
    logger.info("run directory %s", run.path)
    addrs = dist_addrs(args, _free_port)
    args = args.replace(run_dir=run.path, dist_init_addr=addrs[0] or args.dist_init_addr)
    launcher = Launcher(args)
    for sig in (signal.SIGTERM, signal.SIGINT, FORWARD_SIGNAL):
        signal.signal(sig, launcher.request_stop)
    try:
        launcher.start(addrs)
        info = launcher.wait_ready()
    except HyssmError as e:
        print(f"hyssm-launch: error: {e}", file=sys.stderr)
        launcher.shutdown("")
        run.remove()
        return 1
    if args.node_rank == 0:
        logger.info("pools: %s", {k: v for k, v in info.items() if k.endswith("capacity")})
        print(f"hyssm: serving {args.model_name} at http://{args.host}:{args.port}", flush=True)
    else:
        print(f"hyssm: node {args.node_rank} workers ready", flush=True)
    try:
        return launcher.supervise()
    finally:
        run.remove()


if __name__ == "__main__":
    sys.exit(main())
