"""The tokenizer process: HTTP API (SGLang native + OpenAI), tokenisation, incremental
detokenisation, streaming. Entry: `run(args)`; the app alone: `create_app(args, backend)`."""

from __future__ import annotations

from tokenizer_proc.app import create_app
from tokenizer_proc.replicas.scheduler_client import SchedulerClient
from tokenizer_proc.requests.generation import Backend, BackendUnavailable
from tokenizer_proc.server import run

__all__ = ["Backend", "BackendUnavailable", "SchedulerClient", "create_app", "run"]
