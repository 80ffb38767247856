"""The harness counts a chat response's rows (tools/e2e/compare.py): a chat choice has
no prompt_token_ids (its response has them), so before, two equally short chat
answers compared equal. Rows are hand-made: row i holds position i in every slot.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest

from tools.e2e.compare import compare

LAYERS, TOP_K = 2, 2
PROMPT = [11, 12, 13, 14, 15, 16]  # P = 6
COMPLETION = [21, 22, 23]  # C = 3: rows for positions [0, 8)


def _npy_b64(start: int, end: int) -> str:
    rows = np.broadcast_to(
        np.arange(start, end, dtype=np.uint8)[:, None, None], (end - start, LAYERS, TOP_K)
    )
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(rows))
    return base64.b64encode(buffer.getvalue()).decode()


def _chat_response(num_rows: int) -> dict[str, Any]:
    return {
        "prompt_token_ids": PROMPT,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "x"},
            "token_ids": COMPLETION,
            "routed_experts": _npy_b64(0, num_rows),
            "routed_experts_start": 0,
        }],
    }


def test_complete_chat_rows_compare_equal() -> None:
    # P + C - 1 - start = 6 + 3 - 1 - 0 = 8 rows.
    outcome = compare(_chat_response(8), _chat_response(8))
    assert outcome.problem is None
    assert outcome.rows_equal is True


@pytest.mark.parametrize("num_rows", [7, 9])
def test_equally_wrong_chat_rows_are_refused_on_both_sides(num_rows: int) -> None:
    """Negative control: the same wrong count on both sides is no longer equal."""
    outcome = compare(_chat_response(num_rows), _chat_response(num_rows))
    assert outcome.rows_equal is False
    assert outcome.problem is not None
    for side in ("P/D", "colocated"):
        assert (
            f"{side} rows refused by the client decoder: routed_experts has {num_rows} "
            "rows from position 0, expected 8"
        ) in outcome.problem
