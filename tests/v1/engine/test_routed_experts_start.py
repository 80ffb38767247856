"""Routed-experts chunks carry their absolute start (patch
`return-the-absolute-start-position-of-routed-experts`)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm.v1.engine.output_processor import RequestState


def _state() -> RequestState:
    state = object.__new__(RequestState)
    state.request_id = "req-0"
    state.routed_experts_chunks = []
    state.routed_experts_start = None
    return state


def _rows(n: int) -> np.ndarray:
    return np.zeros((n, 2, 2), dtype=np.uint8)


def test_chunks_that_tile_positions_keep_the_first_start() -> None:
    state = _state()
    state.add_routed_experts(_rows(5), 3)  # prefill chunk [3, 8)
    state.add_routed_experts(_rows(1), 8)  # decode steps
    state.add_routed_experts(_rows(1), 9)
    assert state.routed_experts_start == 3
    assert sum(len(c) for c in state.routed_experts_chunks) == 7


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
