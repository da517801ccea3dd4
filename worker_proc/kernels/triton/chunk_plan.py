"""Host-side layout of a ragged SSD scan: which tokens each chunk covers (no triton import).

Chunks start at every request's first token and at
every requested state position, so the state after `pos` tokens of a request is exactly the start
state of the chunk beginning there (or the final state when pos == the request's length), as in
`reference.ssd_chunk_scan_with_states`. The scan result does not depend on where chunks start
beyond float rounding, so breaking chunks at checkpoints costs nothing in accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

FINAL = -1
"""`ChunkPlan.state_chunks` entry meaning "the request's final state"."""


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk layout of one ragged batch. All lists are plain ints (built once on the host)."""

    chunk_size: int
    lengths: tuple[int, ...]  # tokens of each request
    chunk_start: tuple[int, ...]  # global row of each chunk's first token
    chunk_len: tuple[int, ...]  # tokens in each chunk, 1..chunk_size
    req_chunks: tuple[int, ...]  # [B+1]: request r owns chunks req_chunks[r]..req_chunks[r+1]
    state_req: tuple[int, ...]  # request of each requested state, in request order
    state_chunks: tuple[int, ...]  # chunk whose start state is wanted, or FINAL

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_start)

    @property
    def max_len(self) -> int:
        return max(self.lengths, default=0)

    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out

    def device_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chunk_start, chunk_len, req_chunks) as int32 tensors on `device` for the kernels."""
        data = torch.tensor([*self.chunk_start, *self.chunk_len, *self.req_chunks], dtype=torch.int32)
        data = data.to(device, non_blocking=True)
        n = self.num_chunks
        return data[:n], data[n : 2 * n], data[2 * n :]

    def check_integrity(self) -> None:
        """Raise AssertionError unless the chunks tile every request's rows exactly, in order."""
        cu = self.cu_seqlens()
        assert len(self.req_chunks) == len(self.lengths) + 1 and self.req_chunks[0] == 0
        assert self.req_chunks[-1] == self.num_chunks == len(self.chunk_len)
        for r in range(len(self.lengths)):
            row = cu[r]
            for c in range(self.req_chunks[r], self.req_chunks[r + 1]):
                assert self.chunk_start[c] == row and 1 <= self.chunk_len[c] <= self.chunk_size
                row += self.chunk_len[c]
            assert row == cu[r + 1], f"request {r}: chunks cover {row - cu[r]} of {self.lengths[r]} tokens"
        for r, c in zip(self.state_req, self.state_chunks, strict=True):
            assert c == FINAL or self.req_chunks[r] <= c < self.req_chunks[r + 1]


def plan_chunks(
    lengths: Sequence[int], chunk_size: int, state_positions: Sequence[Sequence[int]] | None = None
) -> ChunkPlan:
    """Lay out chunks for requests of `lengths` tokens. `state_positions[r]`: increasing positions
    0 < pos <= lengths[r] whose state request r wants. Raises ValueError on a bad position."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if any(n < 1 for n in lengths):
        raise ValueError(f"every request needs at least one token, got lengths {list(lengths)}")
    positions = state_positions if state_positions is not None else [()] * len(lengths)
    if len(positions) != len(lengths):
        raise ValueError("state_positions needs one entry per request")
    starts: list[int] = []
    lens: list[int] = []
    req_chunks = [0]
    state_req: list[int] = []
    state_chunks: list[int] = []
    row = 0
    for r, (length, wanted) in enumerate(zip(lengths, positions, strict=True)):
        prev = 0
        for pos in wanted:
            if pos < max(prev, 1) or pos > length:
                raise ValueError(f"state position {pos} out of order or outside (0, {length}]")
            prev = pos
        cuts = sorted({0, length, *wanted})
        chunk_at: dict[int, int] = {}
        for seg_start, seg_end in zip(cuts[:-1], cuts[1:], strict=True):
            for s in range(seg_start, seg_end, chunk_size):
                chunk_at[s] = len(starts)
                starts.append(row + s)
                lens.append(min(chunk_size, seg_end - s))
        for pos in wanted:
            state_req.append(r)
            state_chunks.append(FINAL if pos == length else chunk_at[pos])
        row += length
        req_chunks.append(len(starts))
    return ChunkPlan(
        chunk_size=chunk_size,
        lengths=tuple(lengths),
        chunk_start=tuple(starts),
        chunk_len=tuple(lens),
        req_chunks=tuple(req_chunks),
        state_req=tuple(state_req),
        state_chunks=tuple(state_chunks),
    )
