"""Unknown request fields: ignored, and named in the log (as vLLM does).

Rule: a body field this server does not declare changes nothing, so the request is served; the
names are logged at WARNING once per request (top level, and `sampling_params` of /generate) so an
operator sees what clients send. A declared field whose requested behaviour is not supported is a
400 naming it (validation.py / prepare.py), never silently ignored.
"""

from __future__ import annotations

import logging

import msgspec

logger = logging.getLogger(__name__)

_RawObject = dict[str, msgspec.Raw]


def _unknown(raw: dict[str, msgspec.Raw], struct_type: type, prefix: str) -> list[str]:
    known = set(getattr(struct_type, "__struct_fields__", ()))
    return [prefix + k for k in raw if k not in known]


def unknown_fields(data: bytes, body_type: type) -> list[str]:
    """The names of the fields of `data` (a JSON object already decoded as `body_type`) that
    `body_type` does not declare; nested objects are checked for `sampling_params` only."""
    try:
        raw = msgspec.json.decode(data, type=_RawObject)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return []
    names = _unknown(raw, body_type, "")
    sub = raw.get("sampling_params")
    hints = getattr(body_type, "__annotations__", {})
    if sub is not None and "sampling_params" in hints:
        from tokenizer_proc.requests.schemas import NativeSamplingParams

        try:
            names += _unknown(msgspec.json.decode(sub, type=_RawObject), NativeSamplingParams, "sampling_params.")
        except (msgspec.ValidationError, msgspec.DecodeError):
            try:  # a list of them, one per prompt
                for i, one in enumerate(msgspec.json.decode(sub, type=list[_RawObject])):
                    names += _unknown(one, NativeSamplingParams, f"sampling_params[{i}].")
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
    return names


def warn_unknown(data: bytes, body_type: type) -> list[str]:
    names = unknown_fields(data, body_type)
    if names:
        logger.warning("ignoring unknown request fields of %s: %s", body_type.__name__, ", ".join(names))
    return names
