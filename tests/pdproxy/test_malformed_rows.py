"""The proxy's decoder of one side's rows (`vllm_r3_pdproxy.merge.rows_from_choice`)
against the shared table of malformed rows (tests/routed_experts_malformed.py): it
refuses every case with MergeError, and reads each well-formed choice as the rows
written out by hand in the table, as the fork's client decoder reads them. The fork's
decoder runs over the same table in tests/entrypoints/test_routed_experts_malformed.py
(with the negative control of the table's check).
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.entrypoints.routed_experts import decode_routed_experts
from vllm_r3_pdproxy.merge import MergeError, RoutedRows, rows_from_choice

from tests.routed_experts_malformed import (
    CASES,
    START,
    WELL_FORMED,
    WELL_FORMED_ROWS,
    Case,
    assert_refused,
)


def decode_side(choice: dict[str, Any]) -> RoutedRows | None:
    return rows_from_choice(choice, "decode")


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_proxy_refuses_malformed_rows(case: Case) -> None:
    assert_refused(decode_side, MergeError, [case])


@pytest.mark.parametrize(
    ("case", "rows"), zip(WELL_FORMED, WELL_FORMED_ROWS), ids=[c.name for c in WELL_FORMED]
)
def test_the_proxy_reads_well_formed_rows(case: Case, rows: list) -> None:
    got = decode_side(dict(case.choice))
    assert got is not None and got.start == START and got.rows.tolist() == rows


@pytest.mark.parametrize(
    ("case", "rows"), zip(WELL_FORMED, WELL_FORMED_ROWS), ids=[c.name for c in WELL_FORMED]
)
def test_both_decoders_read_well_formed_rows_alike(case: Case, rows: list) -> None:
    fork = decode_routed_experts(dict(case.choice))
    proxy = decode_side(dict(case.choice))
    assert proxy is not None
    assert fork.start == proxy.start == START
    assert fork.rows.tolist() == proxy.rows.tolist() == rows
    assert fork.rows.dtype == proxy.rows.dtype
