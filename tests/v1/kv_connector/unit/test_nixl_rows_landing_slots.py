"""Decode's rows landing slots are cleared before a request's READs (patch
`transfer-routed-experts-rows-with-the-kv-over-nixl`).

A decode block id that held the same tokens' rows before (an earlier pull of the
same prompt, freed and handed out again) keeps a slot whose tag passes that
request's check. If a request's read plan posts no rows READ into it (a plan that
does not read rows, a READ that never lands) the stale slot would pass: fail open.
The NIXL agent is a stand-in whose READs copy registered host memory, so the slots
and the checks run as over a real transport. Rows are distinguishable: row p holds
p in every slot.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.v1.kv_connector.unit.nixl_memory import MemoryNixl
from vllm.distributed.aux_output_connector.rows_transfer import (
    RowsExport,
    RowsFormat,
    RowsMirror,
    block_token_chains,
    pulled_slot_checks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.rows_transfer import (
    NixlRowsTransfer,
)

BS = 4
PROMPT = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32]


def rows(start: int, end: int) -> np.ndarray:
    return np.broadcast_to(
        np.arange(start, end, dtype=np.uint8)[:, None, None], (end - start, 3, 2)
    ).copy()


def decode_with_a_stale_slot() -> tuple[NixlRowsTransfer, RowsMirror, tuple]:
    """Prefill exported the prompt into its blocks 5, 6, 7; decode's blocks 1, 2,
    3 still hold the same tokens' rows from an earlier pull. The checks are those
    of a new pull of the prompt into 1, 2, 3."""
    fmt = RowsFormat(num_layers=3, top_k=2, dtype="uint8", block_size=BS)
    chains = tuple(block_token_chains(PROMPT, BS))
    prefill = RowsMirror(fmt, num_blocks=8)
    prefill.write(RowsExport(0, 10, (5, 6, 7), chains), rows(0, 10))
    decode = RowsMirror(fmt, num_blocks=8)
    decode.slots[[1, 2, 3]] = prefill.slots[[5, 6, 7]]  # the earlier pull
    transfer = NixlRowsTransfer(MemoryNixl(), ["UCX"], decode)
    transfer.add_remote(
        "P",
        "agent-P",
        SimpleNamespace(
            rows_mirror_base_addr=prefill.base_address,
            rows_mirror_num_slots=prefill.num_blocks,
        ),
    )
    transfer._prefill = prefill  # keep its memory alive for the READs
    return transfer, decode, pulled_slot_checks(PROMPT, BS, 0, [1, 2, 3], 0, 10)


def test_without_clearing_a_stale_slot_passes() -> None:
    """The fail-open this guards against, shown on the stand-in: no READ posted,
    no failed block."""
    transfer, _, checks = decode_with_a_stale_slot()
    assert transfer.failed_blocks("r", checks) == set()


def test_a_cleared_slot_that_no_read_filled_fails() -> None:
    transfer, _, checks = decode_with_a_stale_slot()
    transfer.clear_landing_slots(checks)
    assert transfer.failed_blocks("r", checks) == {1, 2, 3}


def test_a_cleared_slot_that_the_read_filled_passes() -> None:
    transfer, decode, checks = decode_with_a_stale_slot()
    transfer.clear_landing_slots(checks)
    transfer.post_read("P", [1, 2, 3], [5, 6, 7])
    assert transfer.failed_blocks("r", checks) == set()
    np.testing.assert_array_equal(decode.slots[1:4], transfer._prefill.slots[5:8])


def test_a_read_into_fewer_slots_is_refused_with_both_counts() -> None:
    transfer, _, _ = decode_with_a_stale_slot()
    with pytest.raises(ValueError, match="2 local and 3 remote blocks"):
        transfer.post_read("P", [1, 2], [5, 6, 7])
