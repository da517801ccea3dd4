"""How several choices of one prompt share its computation: with the prefix cache on, the first is
submitted with `save_prompt_state` and the others only once it has produced its first output (or
ended), so they find its prompt, and its state before the last prompt token, in the cache: the prompt
is computed once, plus its last token once per further choice. Used by flow.respond."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace

from tokenizer_proc.requests.generation import Piece
from tokenizer_proc.requests.prepare import PreparedRequest


def share_prompts(reqs: Sequence[PreparedRequest], cache_on: bool) -> tuple[list[PreparedRequest],
                                                                          dict[int, asyncio.Event]]:
    """The requests with the first choice of each shared prompt marked, and one gate per such prompt."""
    if not cache_on:
        return list(reqs), {}
    counts: dict[int, int] = {}
    for r in reqs:
        counts[r.prompt_index] = counts.get(r.prompt_index, 0) + 1
    gates: dict[int, asyncio.Event] = {}
    out = []
    for r in reqs:
        if counts[r.prompt_index] > 1 and r.sampling.prompt_logprobs < 0 and r.prompt_index not in gates:
            gates[r.prompt_index] = asyncio.Event()
            r = replace(r, save_prompt_state=True)
        out.append(r)
    return out, gates


async def opens(pieces: AsyncIterator[Piece], gate: asyncio.Event) -> AsyncGenerator[Piece, None]:
    try:
        async with contextlib.aclosing(pieces) as it:  # type: ignore[type-var]
            async for piece in it:
                gate.set()
                yield piece
    finally:
        gate.set()


async def after(pieces: AsyncIterator[Piece], gate: asyncio.Event) -> AsyncGenerator[Piece, None]:
    await gate.wait()
    async with contextlib.aclosing(pieces) as it:  # type: ignore[type-var]
        async for piece in it:
            yield piece
