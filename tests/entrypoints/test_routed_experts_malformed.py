"""The fork's client decoder (`vllm.entrypoints.routed_experts.decode_routed_experts`)
against the shared table of malformed rows (tests/routed_experts_malformed.py).

- every malformed case is refused with RoutedExpertsError, as the proxy refuses it
  (tests/pdproxy/test_malformed_rows.py): among them a Fortran-ordered array, bytes
  after the data, .npy version 3.0 and a header that claims 16 TiB of rows, which
  the decoder refuses before allocating anything;
- positive control: each well-formed choice decodes to the rows written out by hand
  in the table (tests/pdproxy/test_malformed_rows.py checks that both decoders read
  them alike);
- negative control: the table's check fails for a decoder that lets one malformed
  case through, and for one that refuses a case with the wrong error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.routed_experts_malformed import (
    CASES,
    START,
    WELL_FORMED,
    WELL_FORMED_ROWS,
    Case,
    assert_refused,
    unrefused,
)
from vllm.entrypoints.routed_experts import (
    RoutedExperts,
    RoutedExpertsError,
    decode_routed_experts,
)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_fork_decoder_refuses_malformed_rows(case: Case) -> None:
    assert_refused(decode_routed_experts, RoutedExpertsError, [case])


def test_the_fork_decoder_refuses_every_case() -> None:
    assert unrefused(decode_routed_experts, RoutedExpertsError, CASES) == {}


@pytest.mark.parametrize(
    ("case", "rows"),
    zip(WELL_FORMED, WELL_FORMED_ROWS),
    ids=[c.name for c in WELL_FORMED],
)
def test_well_formed_rows_decode_to_the_tables_rows(case: Case, rows: list) -> None:
    got = decode_routed_experts(dict(case.choice))
    assert got.start == START and got.rows.tolist() == rows
    assert got.rows.dtype.kind == "u"


def _lets_through(name: str) -> Any:
    """The fork's decoder, except that it returns rows for the case `name`."""
    [let_through] = [case for case in CASES if case.name == name]

    def decode(choice: dict[str, Any]) -> RoutedExperts:
        if choice == let_through.choice:
            return RoutedExperts(0, np.zeros((1, 1, 1), np.uint8))
        return decode_routed_experts(choice)

    return decode


def test_the_table_check_catches_a_decoder_that_accepts_one_bad_case() -> None:
    checked = list(CASES)
    assert_refused(decode_routed_experts, RoutedExpertsError, checked)  # as it is
    lax = _lets_through("ndim-2")
    with pytest.raises(
        AssertionError, match=r"^1 malformed case\(s\) .* ndim-2: accepted"
    ):
        assert_refused(lax, RoutedExpertsError, checked)

    # A refusal with another error is not the decoder's contract either.
    def wrong_error(choice: dict[str, Any]) -> RoutedExperts:
        if choice.get("routed_experts_start") is True:
            raise TypeError("bool start")
        return decode_routed_experts(choice)

    with pytest.raises(
        AssertionError, match=r"start-bool: raised TypeError: bool start"
    ):
        assert_refused(wrong_error, RoutedExpertsError, checked)
