"""POST /generate with several answers (SGLang): a batch (`text` a list of strings, `input_ids` a
list of id lists), with one `sampling_params` for all or a list of one per prompt, and/or
`sampling_params.n` > 1.

Each prompt x choice is one request (tokenizer_proc.requests.prepare.prepare_batch: rid `<rid>-<index>`,
the index counting every prompt's choices in order, `prompt_index * n + i` when n is the same for all;
choice i of a seeded request with seed + i), run through `flow.respond` (the prompt computed once per
prompt). The answer is a JSON list of the single-request objects (native_format.py) in index order;
streamed, every event is one choice's object (cumulative text) with its `index`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.api.native_format import error_of, payload
from tokenizer_proc.context import AppContext
from tokenizer_proc.http.plumbing import sse
from tokenizer_proc.requests.flow import Accumulated, ended, respond
from tokenizer_proc.requests.generation import Piece
from tokenizer_proc.requests.prepare import PreparedRequest


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

