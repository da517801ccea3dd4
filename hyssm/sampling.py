"""`SamplingParams`: the sampling fields of one request, under SGLang's names (vLLM's aliases accepted).

Owner: the caller builds one; `hyssm.Engine` turns it into the `sampling_params` object of POST
/generate (`to_native`) or the fields of POST /v1/chat/completions (`to_chat`). Only the fields
that were set are sent, so the server's defaults and its validation (range checks, grammar
compilation, the 400 naming a field) apply exactly as over HTTP. Immutable.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
"""vLLM's name -> SGLang's name, for fields that differ only by name."""

_CHAT_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "json_schema": "guided_json"}
"""SGLang's name -> the chat endpoint's, where they differ."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling of one request (SGLang's `sampling_params`; vLLM's `max_tokens`, `min_tokens` and
    `logprobs` too). None means "the server's default". `json_schema` may be a dict or its JSON text;
    `logprobs` (vLLM: return this many top alternatives per token) asks for token logprobs."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    seed: int | None = None
    n: int | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    logprobs: int | None = None
    max_tokens: dataclasses.InitVar[int | None] = None
    min_tokens: dataclasses.InitVar[int | None] = None

    def __post_init__(self, max_tokens: int | None, min_tokens: int | None) -> None:
        for alias, value in (("max_tokens", max_tokens), ("min_tokens", min_tokens)):
            if value is None:
                continue
            name = _ALIASES[alias]
            if getattr(self, name) is not None and getattr(self, name) != value:
                raise ValueError(f"SamplingParams: {alias}={value} and {name}={getattr(self, name)} disagree")
            object.__setattr__(self, name, value)
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"SamplingParams: logprobs must be >= 0, got {self.logprobs}")

    @staticmethod
    def of(value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """`value` as SamplingParams (a dict's keys are its field names; an unknown one is a TypeError)."""
        if value is None:
            return SamplingParams()
        if isinstance(value, SamplingParams):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - _field_names())
            if unknown:
                raise TypeError(f"SamplingParams has no field {unknown[0]!r}")
            return SamplingParams(**value)
        raise TypeError(f"sampling_params must be SamplingParams or a dict, not {type(value).__name__}")

    def _set(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None and f.name != "logprobs"}

    def to_native(self) -> dict[str, Any]:
        """The `sampling_params` object of POST /generate."""
        return self._set()

    def to_chat(self) -> dict[str, Any]:
        """The sampling fields of POST /v1/chat/completions (logprobs: `logprobs` + `top_logprobs`)."""
        out = {_CHAT_NAMES.get(k, k): v for k, v in self._set().items()}
        if self.logprobs is not None:
            out.update(logprobs=True, top_logprobs=self.logprobs)
        return out


def _field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(SamplingParams)} | set(_ALIASES)
