"""The checks a request body passes on its way to a `PreparedRequest` (tokenizer_proc.requests.prepare
builds it, for every endpoint): typed decoding (undeclared fields refused), range checks, token ids,
sampling parameters, this server's limits.

Every failure is an `ApiError` (400 naming the field) raised before anything reaches the
scheduler: a request longer than the context never leaves this process.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from shared.config import ServerArgs
from shared.messages import GrammarSpec, SamplingParams
from shared.model_info import VisionInfo
from tokenizer_proc.http.errors import ApiError, bad_request
from tokenizer_proc.requests.context_limit import prompt_too_long, total_too_long
from tokenizer_proc.requests.fields import check_known
from tokenizer_proc.requests.tokenizer import TextTokenizer

T = TypeVar("T")

MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_RID_CHARS = 256
MAX_SEED = (1 << 63) - 1
SEED_FIELDS = ("seed", "sampling_seed")  # the bodies' seed fields (schemas_peer.Seed: any size decodes)
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True)
class Limits:
    """Request limits of this server (from ServerArgs and the model)."""

    context_length: int
    max_new_tokens_limit: int
    vocab_size: int
    vision: VisionInfo | None = None  # a checkpoint that sees: where a prompt's image tokens go (image_parts.py)

    @staticmethod
    def from_args(args: ServerArgs, max_position_embeddings: int, vocab_size: int,
                  vision: VisionInfo | None = None) -> Limits:  # fmt: skip
        return Limits(args.context_length or max_position_embeddings, args.max_new_tokens_limit, vocab_size, vision)


@dataclass(frozen=True)
class SamplingFields:
    """The sampling fields every endpoint shares, as sent (None = not sent)."""

    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    ignore_eos: bool
    seed: int | None
    max_tokens_name: str = "max_new_tokens"
    prefix: str = ""
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    min_tokens_name: str = "min_tokens"
    top_logprobs: int = 0
    top_logprobs_name: str = "top_logprobs"
    prompt_logprobs: int = -1
    grammar: GrammarSpec | None = None
    sglang_wording: bool = False  # SGLang's /generate: its wording of the context refusals (context_limit.py)


def decode_body(data: bytes, body_type: type[T]) -> T:
    """Typed JSON decoding; the error message names the field (msgspec's path). A field the body does
    not declare is a 400 naming it (fields.py)."""
    if not data.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = msgspec.json.decode(data, type=body_type)
    except msgspec.ValidationError as e:
        param = _param_of(str(e))
        if param is not None and param.rsplit(".", 1)[-1] in SEED_FIELDS and "out of range" in str(e):
            raise seed_out_of_range(param) from e  # beyond any integer msgspec decodes
        raise bad_request(f"invalid request: {e}", param) from e
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from e
    except RecursionError as e:  # msgspec decodes nested arrays and objects recursively
        raise too_deep("the request body") from e
    check_known(data, body_type)
    return body


def seed_out_of_range(param: str, value: int | None = None) -> ApiError:
    """The 400 of a seed outside [0, MAX_SEED] (`value` None: too large to decode at all)."""
    got = f", got {value}" if value is not None else ", got an integer far outside it"
    return bad_request(f"{param} must be an integer in [0, {MAX_SEED}] (a non-negative signed 64-bit integer){got}",
                       param)  # fmt: skip


def too_deep(what: str, param: str | None = None, limit: int | None = None) -> ApiError:
    """The 400 for JSON nested deeper than this server reads (`limit` when it is a set bound)."""
    bound = f" (at most {limit} levels)" if limit is not None else ""
    return bad_request(f"{what}: JSON nesting too deep{bound}", param)


def json_depth(value: Any, limit: int) -> int:
    """How deeply arrays and objects nest in `value` (a scalar is 0, `{}` is 1), counted without
    recursion and only up to limit + 1 (a deeper value is answered as limit + 1)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _param_of(message: str) -> str | None:
    """The field a msgspec error points at: `$.a.b` plus the unknown/missing field's name."""
    marker = "at `$."
    at = message.rfind(marker)
    path = message[at + len(marker):].rstrip("`") if at >= 0 else ""
    for lead in ("unknown field `", "missing required field `"):
        if lead in message:
            name = message.split(lead, 1)[1].split("`", 1)[0]
            return f"{path}.{name}" if path else name
    return path or None


def new_rid(prefix: str = "") -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def check_rid(rid: str) -> str:
    if not rid or len(rid) > MAX_RID_CHARS or not rid.isprintable():
        raise bad_request(f"rid must be 1..{MAX_RID_CHARS} printable characters", "rid")
    return rid


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> list[int]:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise bad_request(f"{param} contains token id {bad}, outside [0, {vocab_size})", param)
    return list(ids)


def _check_float(value: float | None, name: str, low: float, high: float, low_open: bool = False) -> None:
    if value is None:
        return
    bad = not math.isfinite(value) or value > high or value < low or (low_open and value == low)
    if bad:
        lo = "(" if low_open else "["
        raise bad_request(f"{name} must be in {lo}{low}, {high}], got {value}", name)


def _stops(stop: str | list[str] | None, name: str) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise bad_request(f"{name} has {len(stops)} strings; at most {MAX_STOPS} are allowed", name)
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad_request(f"{name} strings must be 1..{MAX_STOP_CHARS} characters long", name)
    return tuple(stops)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int, name: str) -> dict[int, float]:
    out: dict[int, float] = {}
    if len(bias or {}) > MAX_LOGIT_BIAS:
        raise bad_request(f"{name} has {len(bias or {})} entries; at most {MAX_LOGIT_BIAS} are allowed", name)
    for key, value in (bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_request(f"{name} keys must be token ids, got {key!r}", name) from None
        if not 0 <= tok < vocab_size:
            raise bad_request(f"{name} names token id {tok}, outside [0, {vocab_size})", name)
        _check_float(value, name, -100.0, 100.0)
        out[tok] = float(value)
    return out


def _extra_params(f: SamplingFields, max_new: int, limits: Limits) -> dict[str, Any]:
    """Penalties, logit_bias, min_tokens and top logprobs, range-checked (vLLM/OpenAI ranges)."""
    p = f.prefix
    _check_float(f.frequency_penalty, p + "frequency_penalty", -2.0, 2.0)
    _check_float(f.presence_penalty, p + "presence_penalty", -2.0, 2.0)
    _check_float(f.repetition_penalty, p + "repetition_penalty", 0.0, 10.0, low_open=True)
    if not 0 <= f.min_tokens <= max_new:
        raise bad_request(f"{p}{f.min_tokens_name} must be in [0, {max_new}] (the maximum new tokens), "
                          f"got {f.min_tokens}", p + f.min_tokens_name)
    if not 0 <= f.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{p}{f.top_logprobs_name} must be in [0, {MAX_TOP_LOGPROBS}], got {f.top_logprobs}",
                          p + f.top_logprobs_name)
    out: dict[str, Any] = {
        "logit_bias": _logit_bias(f.logit_bias, limits.vocab_size, p + "logit_bias"),
        "min_tokens": f.min_tokens, "top_logprobs": f.top_logprobs, "prompt_logprobs": f.prompt_logprobs,
        "grammar": f.grammar,
    }
    for key in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        if (value := getattr(f, key)) is not None:
            out[key] = float(value)
    return out


def build_sampling(
    f: SamplingFields, prompt_len: int, default_max: int | None, limits: Limits, tok: TextTokenizer,
    logprobs: bool = False,
) -> tuple[SamplingParams, tuple[str, ...]]:
    """Range checks, then SamplingParams. `default_max` None = as many as the context allows.
    The prompt must already be non-empty and its length known."""
    p = f.prefix
    mt = p + f.max_tokens_name
    if prompt_len >= limits.context_length:
        raise prompt_too_long(prompt_len, limits.context_length, f.sglang_wording)
    room = limits.context_length - prompt_len
    if f.max_new_tokens is not None:
        if not 0 < f.max_new_tokens <= limits.max_new_tokens_limit:
            raise bad_request(f"{mt} must be in [1, {limits.max_new_tokens_limit}], got {f.max_new_tokens}", mt)
        if f.max_new_tokens > room:
            raise total_too_long(prompt_len, f.max_new_tokens, limits.context_length, f.sglang_wording, mt)
        max_new = f.max_new_tokens
    else:
        max_new = min(room, limits.max_new_tokens_limit, default_max or limits.max_new_tokens_limit)
    _check_float(f.temperature, p + "temperature", 0.0, 1e6)
    _check_float(f.top_p, p + "top_p", 0.0, 1.0, low_open=True)
    _check_float(f.min_p, p + "min_p", 0.0, 1.0)
    if f.top_k is not None and (f.top_k < -1 or f.top_k == 0):
        raise bad_request(f"{p}top_k must be -1 (disabled) or >= 1, got {f.top_k}", p + "top_k")
    if f.seed is not None and not 0 <= f.seed <= MAX_SEED:
        raise seed_out_of_range(p + "seed", f.seed)
    stop_ids = check_token_ids(f.stop_token_ids or [], limits.vocab_size, p + "stop_token_ids")
    if not f.ignore_eos:
        stop_ids += [t for t in tok.extra_stop_ids if t not in stop_ids]
    params: dict[str, Any] = {
        "max_new_tokens": max_new, "stop_token_ids": stop_ids, "ignore_eos": f.ignore_eos,
        "seed": f.seed, "logprobs": logprobs, **_extra_params(f, max_new, limits),
    }
    for key in ("temperature", "top_p", "top_k", "min_p"):
        if (value := getattr(f, key)) is not None:
            params[key] = value
    return SamplingParams(**params), _stops(f.stop, p + "stop")


def require(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise bad_request(message, param)
