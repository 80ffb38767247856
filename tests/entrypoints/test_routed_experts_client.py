"""vllm.entrypoints.routed_experts: what a trainer uses to read the rows.

Fixtures are tiny hand-made arrays whose rows are distinguishable (row i holds
expert ids derived from its absolute position), encoded the way the server
encodes them (vLLM's numpy2base64) and, independently, with numpy's own .npy
writer.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from vllm.entrypoints.routed_experts import (
    RoutedExperts,
    RoutedExpertsError,
    decode_routed_experts,
    merge_by_position,
)
from vllm.utils.serial_utils import numpy2base64

LAYERS, TOP_K = 2, 3


def rows_for(start: int, end: int, dtype=np.uint8) -> np.ndarray:
    """Row of position p: layer l, slot k holds (p + 10 l + k) % 60."""
    p = np.arange(start, end)[:, None, None]
    lk = 10 * np.arange(LAYERS)[None, :, None] + np.arange(TOP_K)[None, None, :]
    return ((p + lk) % 60).astype(dtype)


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def choice(start: int, prompt: int, completion: int, **extra) -> dict:
    return {
        "routed_experts": numpy2base64(rows_for(start, prompt + completion - 1)),
        "routed_experts_start": start,
        "prompt_token_ids": list(range(prompt)),
        "token_ids": list(range(completion)),
        **extra,
    }


def test_decodes_rows_with_their_absolute_start() -> None:
    got = decode_routed_experts(choice(3, 10, 4), num_layers=LAYERS, top_k=TOP_K)
    assert (got.start, got.end, got.rows.shape) == (3, 13, (10, LAYERS, TOP_K))
    assert got.rows.dtype == np.uint8
    # Position 7 (row 4): (7 + 10 l + k) % 60, by hand.
    assert got.at(7).tolist() == [[7, 8, 9], [17, 18, 19]]
    with pytest.raises(RoutedExpertsError, match=r"position 13 is outside .*\[3, 13\)"):
        got.at(13)


def test_numpys_own_npy_and_uint16_decode_too() -> None:
    rows = rows_for(0, 5, np.uint16) + 300
    got = decode_routed_experts(
        {"routed_experts": npy_b64(rows), "routed_experts_start": 0}
    )
    assert got.rows.dtype == np.uint16 and np.array_equal(got.rows, rows)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c.pop("routed_experts"), "--enable-return-routed-experts"),
        (lambda c: c.update(routed_experts=[1, 2]), "got list"),
        (lambda c: c.update(routed_experts="not base64!"), "not a base64 .npy array"),
        (
            lambda c: c.update(routed_experts=base64.b64encode(b"x" * 40).decode()),
            "not a base64 .npy array",
        ),
        (
            lambda c: c.update(routed_experts=c["routed_experts"][:-24]),
            r"holds \d+ data bytes, but its .npy header says shape \(9, 2, 3\)",
        ),
        (lambda c: c.pop("routed_experts_start"), "routed_experts_start .* got None"),
        (lambda c: c.update(routed_experts_start=-1), "got -1"),
        (lambda c: c.update(routed_experts_start="3"), "got '3'"),
        (
            lambda c: c.update(routed_experts=npy_b64(np.zeros((9, 2), np.uint8))),
            r"shape \(rows, layers, top_k\), got \(9, 2\)",
        ),
        (
            lambda c: c.update(routed_experts=npy_b64(np.zeros((9, 2, 3), np.float32))),
            "uint8 or uint16 .* got float32",
        ),
        (
            lambda c: c.update(token_ids=[0, 1, 2, 3, 4]),
            r"9 rows from position 3, expected 10 \(9 prompt \+ 5 completion",
        ),
    ],
)
def test_bad_rows_are_refused_naming_the_field(mutate, message) -> None:
    bad = choice(3, 9, 4)
    mutate(bad)
    with pytest.raises(RoutedExpertsError, match=message):
        decode_routed_experts(bad)


def test_another_models_rows_are_refused() -> None:
    with pytest.raises(RoutedExpertsError, match="has 2 layers, expected 48"):
        decode_routed_experts(choice(0, 4, 2), num_layers=48)
    with pytest.raises(RoutedExpertsError, match="has 3 top_k, expected 8"):
        decode_routed_experts(choice(0, 4, 2), top_k=8)


def test_merging_turns_by_position() -> None:
    """Turn 2's prompt is turn 1's prompt + completion + a new message, sent with
    rows from position 12: the two responses overlap on [12, 15)."""
    turn1 = decode_routed_experts(choice(0, 10, 6))  # rows [0, 15)
    turn2 = decode_routed_experts(choice(12, 20, 3))  # rows [12, 22)
    merged = merge_by_position([turn2, turn1])
    assert (merged.start, merged.end) == (0, 22)
    assert np.array_equal(merged.rows, rows_for(0, 22))
    # uint16 rows come from a model with more than 256 experts: never merged
    # with uint8 ones (negative control: the same rows as uint8 merge).
    wide = RoutedExperts(15, rows_for(15, 17, np.uint16))
    with pytest.raises(RoutedExpertsError, match="are uint16 .* others uint8"):
        merge_by_position([turn1, wide])
    narrow = RoutedExperts(15, rows_for(15, 17))
    assert merge_by_position([turn1, narrow]).end == 17


def test_chat_rows_are_counted_with_the_responses_prompt_ids() -> None:
    """A chat choice has no prompt_token_ids (the response has them): passed in,
    the rows are counted; a short array is refused."""
    full = choice(3, 9, 4)  # rows [3, 12): 9 prompt + 4 completion - 1 - 3 = 9
    prompt = full.pop("prompt_token_ids")
    assert decode_routed_experts(full, prompt_token_ids=prompt).end == 12
    short = dict(full, routed_experts=npy_b64(rows_for(3, 11)))
    assert decode_routed_experts(short).end == 11  # uncounted without the ids
    with pytest.raises(RoutedExpertsError, match=r"8 rows from position 3, expected 9"):
        decode_routed_experts(short, prompt_token_ids=prompt)


def test_merge_refuses_disagreeing_rows_and_gaps() -> None:
    """Negative controls: a flipped expert in the overlap, and a missing range."""
    turn1 = decode_routed_experts(choice(0, 10, 6))
    flipped = rows_for(12, 22)
    flipped[2, 1, 0] += 1  # position 14
    with pytest.raises(
        RoutedExpertsError, match=r"rows differ at position 14 \(1 positions"
    ):
        merge_by_position([turn1, RoutedExperts(12, flipped)])
    with pytest.raises(RoutedExpertsError, match=r"no rows for positions \[15, 16\)"):
        merge_by_position([turn1, RoutedExperts(16, rows_for(16, 18))])
    with pytest.raises(RoutedExpertsError, match="per token"):
        merge_by_position([turn1, RoutedExperts(15, np.zeros((2, 3, 3), np.uint8))])
    with pytest.raises(RoutedExpertsError, match="nothing to merge"):
        merge_by_position([])
