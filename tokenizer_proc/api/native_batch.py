"""POST /generate with several answers (SGLang): a batch (`text` a list of strings, `input_ids` a
list of id lists), with one `sampling_params` for all or a list of one per prompt, and/or
`sampling_params.n` > 1.

Each prompt x choice is one request (rid `<rid>-<index>`, the index counting every prompt's choices
in order, `prompt_index * n + i` when n is the same for all; choice i of a seeded request with
seed + i), run through `flow.respond` (the prompt computed once per prompt). The answer is a JSON
list of the single-request objects (native_format.py) in index order; streamed, every event is one
choice's object (cumulative text) with its `index`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.api.native_format import error_of, payload
from tokenizer_proc.context import AppContext
from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.http.plumbing import sse
from tokenizer_proc.requests.flow import Accumulated, ended, respond
from tokenizer_proc.requests.generation import Piece
from tokenizer_proc.requests.prepare import MAX_N, prepare_generate
from tokenizer_proc.requests.schemas import GenerateBody, NativeSamplingParams
from tokenizer_proc.requests.tokenizer import TextTokenizer
from tokenizer_proc.requests.validation import Limits, PreparedRequest, new_rid, require


def _per_prompt(body: GenerateBody, prompts: int) -> list[NativeSamplingParams]:
    """Each prompt's sampling parameters: the one object for all, or a list of one per prompt (SGLang)."""
    sp = body.sampling_params
    if not isinstance(sp, list):
        return [sp or NativeSamplingParams()] * prompts
    require(len(sp) == prompts, f"sampling_params has {len(sp)} entries for {prompts} prompt(s): give one per "
            "prompt, or one object for all", "sampling_params")  # fmt: skip
    return sp


def _singles(body: GenerateBody) -> list[GenerateBody]:
    """One body per prompt (its sampling_params still the batch's)."""
    if isinstance(body.text, list):
        require(body.input_ids is None, "give either text or input_ids, not both", "text")
        return [msgspec.structs.replace(body, text=t, rid=None) for t in body.text]
    if body.input_ids and all(isinstance(t, list) for t in body.input_ids):
        return [msgspec.structs.replace(body, input_ids=ids, rid=None) for ids in body.input_ids]
    if body.input_ids and any(isinstance(t, list) for t in body.input_ids):
        raise bad_request("input_ids must be token ids or a list of token-id lists, not a mix", "input_ids")
    return [msgspec.structs.replace(body, rid=None)]


def prepare_batch(body: GenerateBody, tok: TextTokenizer, limits: Limits) -> list[PreparedRequest]:
    singles = _singles(body)
    field = "text" if isinstance(body.text, list) else "input_ids"
    require(bool(singles), f"{field} is an empty batch", field)
    params = _per_prompt(body, len(singles))
    listed = isinstance(body.sampling_params, list)
    for pi, sp in enumerate(params):
        name = f"sampling_params[{pi}].n" if listed else "sampling_params.n"
        require(1 <= sp.n <= MAX_N, f"{name} must be in [1, {MAX_N}], got {sp.n}", name)
    require(sum(sp.n for sp in params) <= 2 * MAX_N, f"at most {2 * MAX_N} answers per request",
            "sampling_params" if listed else "sampling_params.n")
    base_rid = body.rid if body.rid is not None else new_rid()
    out: list[PreparedRequest] = []
    for pi, (single, sp) in enumerate(zip(singles, params, strict=True)):
        base = prepare_generate(msgspec.structs.replace(single, sampling_params=msgspec.structs.replace(sp, n=1)),
                                tok, limits)  # fmt: skip
        for i in range(sp.n):
            index = len(out)
            sampling = base.sampling
            if sampling.seed is not None and i > 0:
                sampling = msgspec.structs.replace(sampling, seed=(sampling.seed + i) % (1 << 63))
            out.append(replace(base, rid=f"{base_rid}-{index}", sampling=sampling, index=index, prompt_index=pi))
    return out


def _events(reqs: list[PreparedRequest], pieces: AsyncGenerator[tuple[int, Piece], None],
            started: float) -> AsyncGenerator[bytes, None]:
    return ended(_frames(reqs, pieces, started))


async def _frames(reqs: list[PreparedRequest], pieces: AsyncGenerator[tuple[int, Piece], None],
                  started: float) -> AsyncGenerator[bytes, None]:
    accs = [Accumulated() for _ in reqs]
    async with contextlib.aclosing(pieces) as it:
        async for pos, piece in it:
            accs[pos].add(piece)
            err = error_of(piece.finish)
            if err is not None:
                yield sse(err.body())
                break
            yield sse({**payload(reqs[pos], accs[pos], started), "index": reqs[pos].index})


async def respond_batch(ctx: AppContext, reqs: list[PreparedRequest], request: Request, started: float) -> Response:
    def payloads(accs: list[Accumulated]) -> list[dict[str, Any]]:
        return [payload(r, a, started) for r, a in sorted(zip(reqs, accs, strict=True), key=lambda x: x[0].index)]

    return await respond(ctx, reqs, request, lambda pieces: _events(reqs, pieces, started), error_of,
                                 payloads)

