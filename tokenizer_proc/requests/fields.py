"""Request fields a route does not declare: a 400 naming the first one.

Rules:
- every field a client sends is declared in its body Struct (schemas.py), where it either works or
  is refused with a 400 naming it unless it has its neutral value (compat.py); any other field is
  a 400 "Unrecognized request argument supplied: X" with `param` X (OpenAI's answer), never
  dropped: a dropped field would silently not do what the client asked;
- checked at the top level and in the option objects declared in it, at any depth (`sampling_params`
  of /generate, one object or a list; `stream_options`; `structured_outputs`; `text.format` of
  /v1/responses), the param being the path ("sampling_params.foo", "sampling_params[1].foo");
- a Struct with `open_keys` (chat messages and tool definitions: content, whose extra keys
  clients copy from earlier answers) is not walked: its keys are read where they are used;
- checked after the typed decode, so a value of the wrong type is named first.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import msgspec.inspect as mi

from tokenizer_proc.http.errors import ApiError, bad_request

_RawObject = dict[str, msgspec.Raw]


def unrecognized(param: str) -> ApiError:
    return bad_request(f"Unrecognized request argument supplied: {param}", param)


# per declared field: (the Struct a JSON object there decodes as, the Struct of each item of an array)
_Nested = dict[str, tuple[type | None, type | None]]


@functools.cache
def _plan(cls: type) -> _Nested | None:
    """The declared fields of Struct `cls` and the Structs nested in them; None for an `open_keys`
    Struct. Built once per type (msgspec's type inspection takes milliseconds)."""
    if getattr(cls, "open_keys", False):
        return None
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    out: _Nested = {}
    for field in info.fields:
        options = field.type.types if isinstance(field.type, mi.UnionType) else (field.type,)
        one = next((o.cls for o in options if isinstance(o, mi.StructType)), None)
        each = next((o.item_type.cls for o in options
                     if isinstance(o, mi.ListType) and isinstance(o.item_type, mi.StructType)), None)  # fmt: skip
        out[field.encode_name] = (one, each)
    return out


def _walk(raw: msgspec.Raw, cls: type, path: str) -> str | None:
    """The path of the first undeclared key in the object `raw` (decoded already as `cls`)."""
    plan = _plan(cls)
    if plan is None:
        return None
    try:
        obj = msgspec.json.decode(raw, type=_RawObject)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    for key, value in obj.items():
        name = f"{path}.{key}" if path else key
        if key not in plan:
            return name
        one, each = plan[key]
        first = bytes(memoryview(value)[:1])  # a Raw value starts at its first character: no copy of it
        if first == b"{" and one is not None:
            found = _walk(value, one, name)
        elif first == b"[" and each is not None:
            found = _walk_list(value, each, name)
        else:
            found = None
        if found is not None:
            return found
    return None


def _walk_list(raw: msgspec.Raw, cls: type, path: str) -> str | None:
    try:
        items = msgspec.json.decode(raw, type=list[msgspec.Raw])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    for i, item in enumerate(items):
        if bytes(memoryview(item)[:1]) == b"{" and (found := _walk(item, cls, f"{path}[{i}]")) is not None:
            return found
    return None


def first_unknown(data: bytes, body_type: type[Any]) -> str | None:
    """The path of the first field of `data` (a JSON object already decoded as `body_type`) that
    `body_type` does not declare; None when every field is declared."""
    return _walk(msgspec.Raw(data), body_type, "")


def check_known(data: bytes, body_type: type[Any]) -> None:
    """A 400 naming the first undeclared field of `data` (module doc)."""
    name = first_unknown(data, body_type)
    if name is not None:
        raise unrecognized(name)
