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

from typing import Any

import msgspec
import msgspec.inspect as mi

from tokenizer_proc.http.errors import ApiError, bad_request

_RawObject = dict[str, msgspec.Raw]


def unrecognized(param: str) -> ApiError:
    return bad_request(f"Unrecognized request argument supplied: {param}", param)


def _structs(t: mi.Type) -> tuple[mi.StructType | None, mi.StructType | None]:
    """(the Struct a JSON object of this field decodes as, the Struct of each item of an array)."""
    options = t.types if isinstance(t, mi.UnionType) else (t,)
    one = next((o for o in options if isinstance(o, mi.StructType)), None)
    each = next((o.item_type for o in options
                 if isinstance(o, mi.ListType) and isinstance(o.item_type, mi.StructType)), None)  # fmt: skip
    return one, each


def _walk(raw: msgspec.Raw, info: mi.StructType, path: str) -> str | None:
    """The path of the first undeclared key in the object `raw` (decoded already as `info.cls`)."""
    if getattr(info.cls, "open_keys", False):
        return None
    try:
        obj = msgspec.json.decode(raw, type=_RawObject)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    fields = {f.encode_name: f for f in info.fields}
    for key, value in obj.items():
        name = f"{path}.{key}" if path else key
        field = fields.get(key)
        if field is None:
            return name
        one, each = _structs(field.type)
        first = bytes(value).lstrip()[:1]
        if first == b"{" and one is not None:
            found = _walk(value, one, name)
        elif first == b"[" and each is not None:
            found = _walk_list(value, each, name)
        else:
            found = None
        if found is not None:
            return found
    return None


def _walk_list(raw: msgspec.Raw, info: mi.StructType, path: str) -> str | None:
    try:
        items = msgspec.json.decode(raw, type=list[msgspec.Raw])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    for i, item in enumerate(items):
        if bytes(item).lstrip()[:1] == b"{" and (found := _walk(item, info, f"{path}[{i}]")) is not None:
            return found
    return None


def first_unknown(data: bytes, body_type: type[Any]) -> str | None:
    """The path of the first field of `data` (a JSON object already decoded as `body_type`) that
    `body_type` does not declare; None when every field is declared."""
    info = mi.type_info(body_type)
    assert isinstance(info, mi.StructType)
    return _walk(msgspec.Raw(data), info, "")


def check_known(data: bytes, body_type: type[Any]) -> None:
    """A 400 naming the first undeclared field of `data` (module doc)."""
    name = first_unknown(data, body_type)
    if name is not None:
        raise unrecognized(name)
