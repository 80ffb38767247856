"""The proxy's routed-experts merge (pure functions) and every error path.

Rows are distinguishable: position p holds p (mod 256 for uint8) in every slot.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from vllm_r3_pdproxy.merge import (
    MergeError,
    MergeReport,
    RoutedRows,
    check_coverage,
    decode_npy,
    encode_npy,
    merge_choice,
    merge_rows,
    rows_from_choice,
)

LAYERS, TOPK = 3, 2


def rows(start: int, end: int, dtype: type = np.uint8) -> np.ndarray:
    values = np.arange(start, end) % (256 if dtype == np.uint8 else 65536)
    return np.broadcast_to(
        values.astype(dtype)[:, None, None], (end - start, LAYERS, TOPK)
    ).copy()


def choice(start: int, end: int, dtype: type = np.uint8) -> dict:
    return {
        "index": 0,
        "routed_experts": encode_npy(rows(start, end, dtype)),
        "routed_experts_start": start,
    }


def merged_of(decode_choice: dict) -> RoutedRows:
    out = rows_from_choice(decode_choice, "merged")
    assert out is not None
    return out


def test_pd_merge_takes_prefill_then_decode_from_prefill_end() -> None:
    # P = 6, C = 4, s = 0: prefill [0, 6), decode [5, 9) with one overlapping row at 5.
    decode = choice(5, 9)
    merge_choice(choice(0, 6), decode, prompt_start=0, num_prompt=6, num_completion=4)
    merged = merged_of(decode)
    assert merged.start == 0
    np.testing.assert_array_equal(merged.rows, rows(0, 9))


def test_mid_prompt_start_and_backoff_without_overlap() -> None:
    decode = choice(6, 9)  # back-off b = 1... decode starts exactly where prefill ended
    merge_choice(choice(2, 6), decode, prompt_start=2, num_prompt=6, num_completion=4)
    np.testing.assert_array_equal(merged_of(decode).rows, rows(2, 9))


def test_prompt_start_equal_to_prompt_length_has_no_prefill_rows() -> None:
    decode = choice(6, 9)
    merge_choice(
        {"index": 0, "routed_experts": None},
        decode,
        prompt_start=6,
        num_prompt=6,
        num_completion=4,
    )
    assert merged_of(decode).start == 6


@pytest.mark.parametrize(("prefill_dtype", "decode_dtype"),
                         [(np.uint8, np.uint16), (np.uint16, np.uint8)])
def test_uint8_and_uint16_rows_never_merge(prefill_dtype: type, decode_dtype: type) -> None:
    """uint8 rows come from a model with at most 256 experts, uint16 from one with
    more: the two sides served different models. The ids fit both dtypes, so a
    widening merge would have returned plausible rows."""
    prefill = RoutedRows(0, rows(0, 3, prefill_dtype))
    decode = RoutedRows(2, rows(2, 5, decode_dtype))
    with pytest.raises(MergeError) as info:
        merge_rows(prefill, decode)
    assert str(info.value).startswith(
        f"cannot concatenate routed_experts with dtypes {np.dtype(prefill_dtype)} "
        f"(prefill) and {np.dtype(decode_dtype)} (decode)")
    assert "same model" in str(info.value)


def test_uint16_rows_on_both_sides_merge() -> None:
    """The control: uint16 on both sides (a model with more than 256 experts)."""
    merged = merge_rows(RoutedRows(0, rows(0, 3, np.uint16)), RoutedRows(2, rows(2, 5, np.uint16)))
    assert merged.rows.dtype == np.uint16
    np.testing.assert_array_equal(merged.rows, rows(0, 5, np.uint16))


@pytest.mark.parametrize(
    ("prefill", "decode", "message"),
    [
        (
            RoutedRows(0, rows(0, 6)),
            RoutedRows(7, rows(7, 9)),
            r"gap in routed_experts: prefill rows cover \[0, 6\), decode rows start at 7",
        ),
        (
            RoutedRows(2, rows(2, 6)),
            RoutedRows(1, rows(1, 9)),
            r"decode routed_experts start at 1, before the prefill rows \[2, 6\)",
        ),
        (
            RoutedRows(0, rows(0, 6)),
            RoutedRows(5, rows(6, 10)),
            r"disagree at position 5 \(overlap \[5, 6\), 1 differing rows\)",
        ),
        (
            RoutedRows(0, rows(0, 6)),
            RoutedRows(5, np.zeros((3, LAYERS, TOPK + 1), np.uint8)),
            r"cannot concatenate routed_experts with shapes \(6, 3, 2\) and \(3, 3, 3\)",
        ),
        (
            RoutedRows(0, rows(0, 6).astype(np.uint16)),
            RoutedRows(5, rows(5, 9).astype(np.int32)),
            "cannot concatenate routed_experts with dtypes uint16 \\(prefill\\) and int32",
        ),
    ],
)
def test_merge_errors_name_the_numbers(
    prefill: RoutedRows, decode: RoutedRows, message: str
) -> None:
    with pytest.raises(MergeError, match=message):
        merge_rows(prefill, decode)


def test_coverage_must_be_s_to_p_plus_c_minus_1() -> None:
    check_coverage(RoutedRows(0, rows(0, 9)), 0, 6, 4)
    with pytest.raises(
        MergeError, match=r"cover \[0, 10\), expected .* = \[0, 9\) with P = 6, C = 4"
    ):
        check_coverage(RoutedRows(0, rows(0, 10)), 0, 6, 4)
    with pytest.raises(MergeError, match=r"cover \[1, 9\), expected .* = \[0, 9\)"):
        check_coverage(RoutedRows(1, rows(1, 9)), 0, 6, 4)


def test_a_shifted_decode_segment_is_caught() -> None:
    """Negative control: decode rows labelled one position late must not merge."""
    decode = choice(5, 9)
    decode["routed_experts_start"] = 6
    with pytest.raises(MergeError, match=r"cover \[0, 10\)"):
        merge_choice(
            choice(0, 6), decode, prompt_start=0, num_prompt=6, num_completion=4
        )


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "routed_experts",
            12,
            "decode routed_experts must be a base64 .npy string, got int",
        ),
        ("routed_experts", "!!!", "decode routed_experts is not valid base64"),
        (
            "routed_experts",
            base64.b64encode(b"not npy").decode(),
            r"is not a .npy array \(7 bytes\)",
        ),
        (
            "routed_experts",
            encode_npy(np.zeros((3, 2), np.uint8)),
            r"must have shape \(seq, layers, topk\), got \(3, 2\)",
        ),
        (
            "routed_experts",
            encode_npy(np.zeros((3, 2, 2), np.float32)),
            "has dtype float32; expected uint8 or uint16",
        ),
        (
            "routed_experts",
            base64.b64encode(_npy_bytes(rows(5, 9))[:-4]).decode(),
            r"holds 20 data bytes, but its header says shape \(4, 3, 2\) of uint8 = 24 bytes",
        ),
        (
            "routed_experts",
            encode_npy(rows(5, 9)).replace("A", "\n", 1),
            "decode routed_experts is not valid base64",
        ),
        (
            "routed_experts",
            base64.b64encode(_npy_bytes(np.asfortranarray(rows(5, 9)))).decode(),
            "must be a C-ordered plain array, got fortran_order=True",
        ),
        (
            "routed_experts_start",
            None,
            "routed_experts_start must be a non-negative integer, got None",
        ),
        ("routed_experts_start", -1, "got -1"),
    ],
)
def test_malformed_fields_are_rejected(field: str, value: object, message: str) -> None:
    decode = choice(5, 9)
    decode[field] = value
    with pytest.raises(MergeError, match=message):
        merge_choice(choice(0, 6), decode, 0, 6, 4)


def test_missing_decode_rows_when_prefill_has_them() -> None:
    with pytest.raises(
        MergeError, match="prefill response contained routed_experts, but decode"
    ):
        merge_choice(choice(0, 6), {"index": 0, "routed_experts": None}, 0, 6, 4)


def test_neither_side_with_rows_is_a_no_op() -> None:
    decode = {"index": 0, "routed_experts": None}
    merge_choice({"index": 0}, decode, 0, 6, 4)
    assert decode == {"index": 0, "routed_experts": None}


def test_complete_decode_rows_pass_through_byte_for_byte() -> None:
    # Rows traveled with the KV: prefill returns none, decode all of [s, P + C - 1).
    decode = choice(2, 9)
    before = dict(decode)
    merge_choice({"index": 0}, decode, 2, 6, 4)
    assert decode == before


def test_a_pass_through_that_is_not_complete_is_still_refused() -> None:
    with pytest.raises(MergeError, match=r"cover \[2, 8\), expected .* \[2, 9\)"):
        merge_choice({"index": 0}, choice(2, 8), 2, 6, 4)


def test_npy_round_trip_is_byte_identical_to_numpy_save() -> None:
    array = rows(0, 7, np.uint16)
    np.testing.assert_array_equal(decode_npy(encode_npy(array), "x"), array)
    assert base64.b64decode(encode_npy(array)) == _npy_bytes(array)
    sliced = rows(0, 7)[2:5]
    assert base64.b64decode(encode_npy(sliced)) == _npy_bytes(sliced)


def test_overlap_policies_choose_a_side_and_report_the_difference() -> None:
    prefill, decode = (
        RoutedRows(0, rows(0, 6)),
        RoutedRows(5, rows(6, 10)),
    )  # row 5 differs
    report = MergeReport()
    kept_prefill = merge_rows(prefill, decode, "prefill", report)
    np.testing.assert_array_equal(kept_prefill.rows[:6], rows(0, 6))
    np.testing.assert_array_equal(kept_prefill.rows[6:], rows(7, 10))
    assert (report.overlap_rows_differing, report.first_differing_position) == (1, 5)
    kept_decode = merge_rows(prefill, decode, "decode")
    np.testing.assert_array_equal(kept_decode.rows[:5], rows(0, 5))
    np.testing.assert_array_equal(kept_decode.rows[5:], rows(6, 10))
    assert len(kept_prefill.rows) == len(kept_decode.rows) == 9
    with pytest.raises(ValueError, match="overlap policy 'newest'"):
        merge_rows(prefill, decode, "newest")
