"""The checks a launch passes before any process starts, each failing fast with one line
(`ConfigError`): the checkpoint is readable and its quantization loadable here, its heads split over
--tp-size, NEXTN has MTP layers to draft with, --chat-template compiles, the HTTP port is free, the
GPUs are there; on a node other than 0, node 0's rendezvous address answers (waited for up to
--startup-timeout).

Owner: launch.py's `main` and `hyssm.Engine` run `preflight` with resolved arguments (a Hub id is
already a local snapshot). It starts nothing and imports no torch except to count GPUs; the
tokenizer's and the workers' modules it asks are torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from shared.config import ConfigError, ServerArgs
from shared.lora_paths import LoraError, startup_adapters
from shared.model_info import ModelInfo

logger = logging.getLogger(__name__)


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
    try:
        startup_adapters(args)  # every --lora-paths adapter is readable and fits this model
    except LoraError as e:
        raise ConfigError(f"--lora-paths: {e}") from None
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
    from worker_proc.loading.checkpoint_config import check_requested, parse_quantization_config  # torch-free

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
