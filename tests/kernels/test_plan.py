"""`plan_chunks`: the host-side chunk layout of a ragged SSD scan (pure Python, no kernels)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_proc.kernels.triton.chunk_plan import FINAL, plan_chunks


def test_chunks_restart_at_each_request_and_state_position() -> None:
    plan = plan_chunks([7, 3, 12], 5, [(), (3,), (4, 5, 12)])
    plan.check_integrity()
    assert plan.chunk_start == (0, 5, 7, 10, 14, 15, 20)
    assert plan.chunk_len == (5, 2, 3, 4, 1, 5, 2)
    assert plan.req_chunks == (0, 2, 3, 7)
    assert plan.state_req == (1, 2, 2, 2)
    assert plan.state_chunks == (FINAL, 4, 5, FINAL)
    assert plan.cu_seqlens() == [0, 7, 10, 22] and plan.max_len == 12


@pytest.mark.parametrize(
    ("lengths", "chunk", "positions"),
    [([0], 4, None), ([3], 0, None), ([5], 4, [(0,)]), ([5], 4, [(6,)]), ([5], 4, [(3, 2)]), ([5, 2], 4, [()])],
)
def test_bad_layouts_are_refused(lengths: list[int], chunk: int, positions: list[tuple[int, ...]] | None) -> None:
    with pytest.raises(ValueError):
        plan_chunks(lengths, chunk, positions)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=5),
    st.integers(1, 9),
    st.data(),
)
def test_random_layouts_tile_every_request(lengths: list[int], chunk: int, data: st.DataObject) -> None:
    positions = [tuple(sorted(data.draw(st.sets(st.integers(1, n), max_size=3)))) for n in lengths]
    plan = plan_chunks(lengths, chunk, positions)
    plan.check_integrity()
    assert len(plan.state_req) == sum(len(p) for p in positions)
    for r, c in zip(plan.state_req, plan.state_chunks, strict=True):
        assert c == FINAL or plan.chunk_start[c] - plan.cu_seqlens()[r] in positions[r]
