"""What sglang-router (the SGLang model gateway) asks a worker, in SGLang's shapes.

A router registering a worker reads `GET /server_info` (falling back to `/get_server_info`) for
`model_path`, `served_model_name`, `tp_size`, `dp_size` and the capacity fields, and
`GET /model_info` (falling back to `/get_model_info`) for `model_path`, `tokenizer_path`,
`is_generation`, `model_type` and `architectures` (hyssm adds `layer_kinds` and `state_kinds`: what
one state slot holds per recurrent layer kind, `ModelInfo.state_kinds`); it then probes `GET /health` (or the endpoint
given by `--health-check-endpoint`, e.g. `/health_generate`), reads `GET /get_load` for its
load-aware policies and fans `POST /flush_cache` out to every worker.

Rules: the info documents put SGLang's flat server-argument names at the top level (SGLang
returns its ServerArgs flattened) next to hyssm's own nested keys, so both kinds of reader work.
`/get_load` is a list with one entry per data-parallel rank that answers (a replica that is down
has none):
`{"dp_rank", "num_reqs" (running + waiting), "num_waiting_reqs", "num_tokens" (KV token slots held
by requests)}`, plus the HTTP server's admission figures, the same in every entry (one HTTP server
admits for all replicas): `num_queued_reqs` (admitted beyond the running slots), `max_queued_reqs`,
`num_refused_reqs` (503s since start: queue full or draining) and `draining`; a scheduler that does
not answer is 503, never a made-up zero load.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from shared.model_info import ModelInfo, read_config_json
from tokenizer_proc.context import AppContext, get_ctx
from tokenizer_proc.http.errors import unavailable
from tokenizer_proc.http.plumbing import json_response
from tokenizer_proc.replicas.backend import ReplicatedBackend
from tokenizer_proc.requests.generation import BackendUnavailable

logger = logging.getLogger(__name__)


def sglang_server_fields(ctx: AppContext) -> dict[str, Any]:
    """The flat SGLang ServerArgs names a router reads from /server_info (hyssm's values)."""
    args = ctx.args
    return {
        "model_path": args.resolved_model_path,
        "tokenizer_path": args.resolved_model_path,
        "served_model_name": args.model_name,
        "tp_size": args.tp_size,
        "dp_size": getattr(args, "dp_size", 1),
        "nnodes": args.nnodes,
        "max_running_requests": args.max_running_requests,
        "max_total_tokens": args.max_total_tokens or None,
        "max_prefill_tokens": args.max_prefill_tokens,
        "chunked_prefill_size": args.chunked_prefill_size,
        "context_length": ctx.limits.context_length,
        "disable_radix_cache": args.disable_radix_cache,
        "schedule_policy": args.schedule_policy,
        "disaggregation_mode": "null",
    }


def sglang_model_fields(ctx: AppContext) -> dict[str, Any]:
    """The /model_info fields a router reads: paths, model_type and architectures of config.json; and
    hyssm's layer kinds and state kinds of the model."""
    path = ctx.args.resolved_model_path
    try:
        cfg = read_config_json(path)
        info: ModelInfo | None = ModelInfo.from_dir(path)
    except Exception as e:  # noqa: BLE001 - the model loaded at start-up; a later read failure is only logged
        logger.warning("model_info without config.json fields: %s", e)
        cfg, info = {}, None
    return {
        "model_path": path,
        "tokenizer_path": path,
        "model_type": cfg.get("model_type"),
        "architectures": cfg.get("architectures"),
        "layer_kinds": list(info.layer_kinds) if info else None,
        "state_kinds": info.state_kinds if info else None,
    }


async def get_load(request: Request) -> Response:
    """GET /get_load: one entry per data-parallel rank that answered (see the module rules)."""
    ctx = get_ctx(request)
    backend = ctx.backend
    try:
        if isinstance(backend, ReplicatedBackend):
            states = {d: info.server for d, info in (await backend.replica_infos()).items()}
        else:
            states = {0: (await backend.info()).server}
    except (BackendUnavailable, TimeoutError) as e:
        raise unavailable(f"the scheduler did not answer: {e}") from e
    admitted = len(ctx.in_flight)
    server = {  # the HTTP server's admission (tokenizer_proc/requests/admission.py), one for every replica
        "num_queued_reqs": ctx.admission.queued(admitted),
        "max_queued_reqs": ctx.admission.limit - ctx.admission.running_slots,
        "num_refused_reqs": sum(ctx.admission.refused.values()),
        "draining": ctx.admission.draining,
    }
    return json_response([{
        "dp_rank": d,
        "num_reqs": state.num_running + state.num_waiting,
        "num_waiting_reqs": state.num_waiting,
        "num_tokens": state.kv_used_by_requests,
        **server,
    } for d, state in sorted(states.items())])  # fmt: skip
