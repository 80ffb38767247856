"""Routed-experts chunks carry their absolute start (patch
`return-the-absolute-start-position-of-routed-experts`).

The engine sends a chunk's start only where the chunk does not continue the
request's previous one; the output processor continues the others from the
previous end and fails a start that is not that end."""

from __future__ import annotations

import numpy as np
import pytest

from vllm.v1.engine.output_processor import RequestState


def _state() -> RequestState:
    state = object.__new__(RequestState)
    state.request_id = "req-0"
    state.routed_experts_chunks = []
    state.routed_experts_start = None
    state.routed_experts_end = None
    return state


def _rows(n: int) -> np.ndarray:
    return np.zeros((n, 2, 2), dtype=np.uint8)


def test_chunks_that_tile_positions_keep_the_first_start() -> None:
    state = _state()
    state.add_routed_experts(_rows(5), 3)  # prefill chunk [3, 8)
    state.add_routed_experts(_rows(1), 8)  # a start that continues: accepted
    state.add_routed_experts(_rows(1), None)  # decode steps: no start sent
    state.add_routed_experts(_rows(2), None)
    assert state.routed_experts_start == 3
    assert state.routed_experts_end == 3 + 5 + 1 + 1 + 2
    assert sum(len(c) for c in state.routed_experts_chunks) == 9


@pytest.mark.parametrize(("second_start", "kind"), [(9, "gap"), (7, "overlap")])
def test_a_gap_or_overlap_fails_instead_of_mislabelling(
    second_start: int, kind: str
) -> None:
    state = _state()
    state.add_routed_experts(_rows(5), 3)
    with pytest.raises(
        RuntimeError, match=f"chunk starts at {second_start}, expected 8"
    ):
        state.add_routed_experts(_rows(1), second_start)


def test_a_start_after_chunks_without_one_is_checked_against_their_end() -> None:
    state = _state()
    state.add_routed_experts(_rows(4), 0)
    state.add_routed_experts(_rows(1), None)
    state.add_routed_experts(_rows(1), None)  # [0, 6)
    state.add_routed_experts(_rows(1), 6)  # continues
    with pytest.raises(RuntimeError, match="chunk starts at 5, expected 7"):
        state.add_routed_experts(_rows(1), 5)


def test_rows_without_any_start_stay_unlabelled() -> None:
    # An engine that sends no start (routed experts from an older engine core):
    # the rows are kept and no start is made up.
    state = _state()
    state.add_routed_experts(_rows(3), None)
    state.add_routed_experts(_rows(1), None)
    assert state.routed_experts_start is None and state.routed_experts_end is None
    assert sum(len(c) for c in state.routed_experts_chunks) == 4
