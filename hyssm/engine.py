"""`hyssm.Engine`: the serving engine as a Python object, without an HTTP port unless one is asked for.

    with hyssm.Engine(model_path="builtin") as engine:
        out = engine.generate(["Once upon a time"], hyssm.SamplingParams(max_new_tokens=16, temperature=0))

How it works: the Engine runs the very processes `launch.py` runs (tokenizer, scheduler, worker
ranks; the launch's `Launcher` starts and supervises them: hyssm/launcher.py, driven from
hyssm/processes.py) and talks to the tokenizer process's own HTTP API over a private unix domain
socket in the launch's run directory (readable by this user only; no TCP port). So every request is
validated, scheduled, streamed and answered exactly as over HTTP: the results are POST /generate's
objects (`text`, `output_ids`, `meta_info` with `finish_reason`, `prompt_tokens`,
`completion_tokens`, `cached_tokens`, and the logprobs when asked) and `chat` returns POST
/v1/chat/completions' object. Passing `port` (or `host`) serves the HTTP API there too, as `hyssm
serve` does, and the Engine then uses that port.

What must hold:
- a model path that is a Hugging Face Hub id is resolved to a local snapshot before any process
  starts (shared/hub.py), and the same checks as launch.py's run (hyssm/preflight.py); both raise
  ConfigError;
- when any process dies, every waiting call and every later call raises EngineDeadError naming it;
- `shutdown()` (also on leaving a `with` block, and at interpreter exit) stops every child and
  removes the run directory; afterwards no process of the engine is left.
Children are fresh interpreters (shared/child_process.py) that do not import the script that created
the Engine, so it needs no `if __name__ == "__main__":` guard. A SIGTERM sent to a scheduler or worker process is
passed on to its parent, this process (shared/proc.py), as launch.py would receive it.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from hyssm.client import Client
from hyssm.errors import EngineError
from hyssm.preflight import preflight
from hyssm.processes import Processes
from hyssm.sampling import SamplingParams
from shared.config import BUILTIN_MODEL, ConfigError, FaultConfig, ServerArgs
from shared.errors import HyssmError
from shared.hub import resolve_model

logger = logging.getLogger(__name__)

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
OneOrMoreParams = SamplingParams | dict[str, Any] | list[SamplingParams | dict[str, Any]] | None  # a list: per prompt

_INTERNAL = ("run_dir", "dp_rank", "http_uds")


def server_args(model_path: str, kwargs: dict[str, Any]) -> ServerArgs:
    """ServerArgs from the Engine's keyword arguments (ServerArgs field names; `faults` may be a dict)."""
    names = {f.name for f in dataclasses.fields(ServerArgs)} - set(_INTERNAL)
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"Engine: unknown server argument {unknown[0]!r} (the fields of shared.config.ServerArgs)")
    if isinstance(kwargs.get("faults"), dict):
        kwargs = {**kwargs, "faults": FaultConfig(**kwargs["faults"])}
    return ServerArgs(model_path=model_path, **kwargs)


class Engine:
    """A running engine (module docstring). Thread-safe: calls may come from any thread or event loop."""

    def __init__(self, model_path: str = BUILTIN_MODEL, **kwargs: Any) -> None:
        """Start the processes and return once every one is ready. `kwargs`: ServerArgs fields
        (`tp_size`, `dtype`, `max_running_requests`, `revision`, `download_dir`, ...). Raises
        ConfigError for a bad argument or model, EngineError when a process fails to start."""
        tcp = "port" in kwargs or "host" in kwargs
        args = resolve_model(server_args(model_path, kwargs))
        self._procs = Processes(args, uds=not tcp)
        self.args = self._procs.args
        try:
            preflight(self.args)
            self._procs.start()
        except ConfigError:
            self._procs.stop()
            raise
        except HyssmError as e:
            self._procs.stop()
            raise EngineError(f"the engine did not start: {e}") from None
        except BaseException:  # interrupted while starting: nothing may be left running
            self._procs.stop()
            raise
        self.args = self._procs.args
        host = "127.0.0.1" if self.args.host in ("0.0.0.0", "::", "") else self.args.host
        self.url = f"http://{host}:{self.args.port}" if tcp else ""
        self._client = Client(self.url or "http://hyssm", self._procs.socket_path, self.args.api_key,
                              self._death)
        self._closed = False
        atexit.register(self.shutdown)
        logger.info("engine ready: %s (%s)", self.args.model_name, self.url or self._procs.socket_path)

    # ---- lifetime -----------------------------------------------------------------------------------
    def _death(self, timeout: float) -> str:
        self._procs.dead.wait(timeout)
        return self._procs.failure if self._procs.dead.is_set() else ""

    @property
    def pids(self) -> dict[str, int]:
        """The engine's child processes: name ("tokenizer", "scheduler", "worker-tp0", ...) -> pid."""
        return self._procs.pids

    def shutdown(self) -> None:
        """Stop every process of the engine as launch.py stops on SIGTERM (the tokenizer first: calls
        still waiting get their answers, within its drain period, then the rest); idempotent. Later
        calls raise EngineDeadError."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self._procs.stop()
        self._client.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- generation ---------------------------------------------------------------------------------
    def _generate_body(self, prompt: Prompt, input_ids: InputIds, sampling_params: Any, stream: bool,
                       options: dict[str, Any]) -> dict[str, Any]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        listed = isinstance(sampling_params, list)  # one per prompt (vLLM's and SGLang's list form)
        sps = [SamplingParams.of(one) for one in sampling_params] if listed else [SamplingParams.of(sampling_params)]
        native = [sp.to_native() for sp in sps]
        body: dict[str, Any] = {"sampling_params": native if listed else native[0], "stream": stream}
        body["text" if prompt is not None else "input_ids"] = prompt if prompt is not None else input_ids
        asked = {sp.logprobs for sp in sps if sp.logprobs is not None}
        if len(asked) > 1:
            raise ValueError("sampling_params: the prompts of one call ask for one number of logprobs")
        if asked:
            body.update(return_logprob=True, top_logprobs_num=asked.pop())
        body.update({k: v for k, v in options.items() if v is not None})
        return body

    def generate(self, prompt: Prompt = None, sampling_params: OneOrMoreParams = None, *,
                 input_ids: InputIds = None, return_logprob: bool | None = None, top_logprobs_num: int | None = None,
                 logprob_start_len: int | None = None, priority: int | None = None,
                 rid: str | None = None, lora_path: str | list[str | None] | None = None,
                 ) -> dict[str, Any] | list[dict[str, Any]]:
        """POST /generate: one prompt (text or ids) gives one result; a list of prompts (or `n` > 1)
        gives a list, in input order (prompt i's choice j at i * n + j). `sampling_params` is one for
        every prompt or a list of one per prompt; `lora_path` names the LoRA adapter (SGLang's: its name,
        or a list of one per prompt; None = the base model). Raises RequestError for a
        request the server refuses (the message names the field), EngineDeadError when the engine died."""
        body = self._generate_body(prompt, input_ids, sampling_params, False, {
            "return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
            "logprob_start_len": logprob_start_len, "priority": priority, "rid": rid, "lora_path": lora_path})
        return self._client.request("POST", "/generate", body)

    async def async_generate(self, prompt: Prompt = None,
                             sampling_params: OneOrMoreParams = None, *,
                             input_ids: InputIds = None, stream: bool = False, return_logprob: bool | None = None,
                             top_logprobs_num: int | None = None, logprob_start_len: int | None = None,
                             priority: int | None = None, rid: str | None = None,
                             lora_path: str | list[str | None] | None = None,
                             ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict]:
        """As `generate`, awaited. With `stream=True` it returns an async iterator of the server's
        stream objects: each the request's result so far (cumulative `text` and `output_ids`,
        `meta_info.finish_reason` null until the last; with a batch or `n` > 1 each carries its `index`)."""
        body = self._generate_body(prompt, input_ids, sampling_params, stream, {
            "return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
            "logprob_start_len": logprob_start_len, "priority": priority, "rid": rid, "lora_path": lora_path})
        if stream:
            self._client.check_alive()
            return self._client.stream("/generate", body)
        return await self._client.arequest("POST", "/generate", body)

    def _chat_body(self, messages: list[dict[str, Any]], sampling_params: Any, stream: bool,
                   options: dict[str, Any]) -> dict[str, Any]:
        """The chat body; `extra` may name a LoRA adapter as `model` or `lora_path`."""
        body: dict[str, Any] = {"model": self.args.model_name, "messages": messages, "stream": stream,
                                "return_token_ids": True, **SamplingParams.of(sampling_params).to_chat()}
        body.update({k: v for k, v in options.items() if v is not None})
        return body

    def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | dict[str, Any] | None = None,
             *, tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
             chat_template_kwargs: dict[str, Any] | None = None, response_format: dict[str, Any] | None = None,
             **extra: Any) -> dict[str, Any]:
        """POST /v1/chat/completions: `messages` rendered by the model's chat template. Returns the
        chat completion object (`choices[i].message`, `finish_reason`, `token_ids`, `usage` with
        `prompt_tokens_details.cached_tokens`); `extra` are more fields of that endpoint."""
        body = self._chat_body(messages, sampling_params, False, {
            "tools": tools, "tool_choice": tool_choice, "chat_template_kwargs": chat_template_kwargs,
            "response_format": response_format, **extra})
        return self._client.request("POST", "/v1/chat/completions", body)

    async def async_chat(self, messages: list[dict[str, Any]],
                         sampling_params: SamplingParams | dict[str, Any] | None = None, *, stream: bool = False,
                         **extra: Any) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        """As `chat`, awaited; with `stream=True` an async iterator of the chat completion chunks."""
        body = self._chat_body(messages, sampling_params, stream, extra)
        if stream:
            self._client.check_alive()
            return self._client.stream("/v1/chat/completions", body)
        return await self._client.arequest("POST", "/v1/chat/completions", body)

    # ---- introspection --------------------------------------------------------------------------------
    def get_server_info(self) -> dict[str, Any]:
        """GET /get_server_info: the configuration and the scheduler's state (pools, queues, requests)."""
        return self._client.request("GET", "/get_server_info")

    def flush_cache(self) -> dict[str, Any]:
        """POST /flush_cache: empty the prefix cache."""
        return self._client.request("POST", "/flush_cache")

    # ---- LoRA adapters (with enable_lora=True or lora_paths) ----------------------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """POST /load_lora_adapter: serve the PEFT adapter at `lora_path` as `lora_name` (RequestError when it
        cannot be served: the message says why)."""
        return self._client.request("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """POST /unload_lora_adapter: requests naming it are refused from now on; running ones finish under it."""
        return self._client.request("POST", "/unload_lora_adapter", {"lora_name": lora_name})
