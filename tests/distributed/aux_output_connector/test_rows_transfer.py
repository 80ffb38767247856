"""Routed-expert rows that travel with their KV blocks (patch
`keep-routed-experts-rows-per-kv-block-in-a-mirror-a`): the rows mirror, its tags,
and the prefill export -> slot copy -> decode import round trip on real
`AuxOutputWorkerConnector`s.

Rows are distinguishable: row p holds the value p in every slot (decode's own
recomputed rows hold 100 + p), so every output shows which instance computed
which position. Expected values are written out by hand from the block layout.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from tests.dash_o import json_under_dash_o
from tests.distributed.aux_output_connector.aux_worker_utils import (
    bare_worker,
    run_step,
)
from tests.distributed.aux_output_connector.rows_transfer_utils import (
    BS,
    PROMPT,
    SHAPE,
    fmt,
    rows,
)
from vllm.distributed.aux_output_connector.connector import (
    AuxOutputConnectorMetadata,
    AuxRequestOutput,
    PackedBlockHashes,
)
from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer
from vllm.distributed.aux_output_connector.rows_transfer import (
    RowsExport,
    RowsFormat,
    RowsImport,
    RowsMirror,
    SlotCheck,
    block_token_chains,
    check_peer_rows_format,
    import_checked_rows,
    pulled_slot_checks,
)
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector

# --- tags and checks ----------------------------------------------------------------


def test_chains_change_from_the_block_with_a_different_token_on() -> None:
    chains = block_token_chains(PROMPT, BS)
    assert len(chains) == 3
    other = block_token_chains([*PROMPT[:5], 99, *PROMPT[6:]], BS)  # token 5: block 1
    assert other[0] == chains[0]
    assert other[1] != chains[1] and other[2] != chains[2]
    # A prefix has the same chains as the full prompt, block by block.
    assert block_token_chains(PROMPT[:8], BS) == chains[:2]


def test_pulled_slot_checks_hand_derived() -> None:
    # Blocks 1 and 2 pulled into local blocks 7 and 8; rows needed from 6, KV to 10.
    checks = pulled_slot_checks(PROMPT, BS, 1, [7, 8], rows_start=6, pull_end=10)
    chains = block_token_chains(PROMPT, BS)
    assert checks == (SlotCheck(7, chains[1], 2, 4), SlotCheck(8, chains[2], 0, 2))
    # Rows needed from the prompt's end: nothing to check.
    assert (
        pulled_slot_checks(PROMPT, BS, 0, [1, 2, 3], rows_start=10, pull_end=10) == ()
    )


def _exported_mirror(start: int = 0, end: int = 10) -> RowsMirror:
    mirror = RowsMirror(fmt(), num_blocks=8)
    chains = tuple(block_token_chains(PROMPT, BS))
    mirror.write(
        RowsExport(start, end, (5, 6, 7)[start // BS :], chains), rows(start, end)
    )
    return mirror


def test_written_slots_pass_their_checks_and_read_back() -> None:
    mirror = _exported_mirror()
    for check in pulled_slot_checks(PROMPT, BS, 0, [5, 6, 7], 0, 10):
        assert mirror.slot_problem(check) is None
    np.testing.assert_array_equal(
        mirror.read(RowsImport(2, 10, (5, 6, 7))), rows(2, 10)
    )


def _untag(mirror: RowsMirror) -> None:
    mirror.invalidate([6])


def _corrupt_a_row(mirror: RowsMirror) -> None:
    mirror.slots[6, 0] = 200


def _other_tokens(mirror: RowsMirror) -> None:
    mirror.slots[6, mirror.format.rows_nbytes + 16] ^= 1  # the token chain word


@pytest.mark.parametrize(
    ("plant", "problem"),
    [
        (_untag, "no rows"),
        (_corrupt_a_row, "checksum"),
        (_other_tokens, "other tokens"),
    ],
)
def test_a_planted_fault_in_one_slot_fails_exactly_that_check(plant, problem) -> None:
    mirror = _exported_mirror()
    plant(mirror)
    checks = pulled_slot_checks(PROMPT, BS, 0, [5, 6, 7], 0, 10)
    problems = [mirror.slot_problem(check) for check in checks]
    assert problems[0] is None and problems[2] is None
    assert problems[1] is not None and problem in problems[1]


def test_invalidating_clears_exactly_the_named_tags() -> None:
    mirror = _exported_mirror()
    rows_before = mirror.slots[:, : mirror.format.rows_nbytes].copy()
    mirror.invalidate([5, 7])
    mirror.invalidate([])
    problems = [
        mirror.slot_problem(check)
        for check in pulled_slot_checks(PROMPT, BS, 0, [5, 6, 7], 0, 10)
    ]
    assert problems[1] is None
    assert "no rows" in problems[0] and "no rows" in problems[2]
    # Only the tags: the rows bytes are what they were.
    np.testing.assert_array_equal(
        mirror.slots[:, : mirror.format.rows_nbytes], rows_before
    )


def _resident_fraction(array: np.ndarray) -> float:
    """The share of ``array``'s pages that are mapped (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = array.ctypes.data // page * page
    end = array.ctypes.data + array.nbytes
    pages = (end - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec):
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) / pages


def test_a_new_mirror_is_mapped_before_its_first_write() -> None:
    # 48 MiB of slots: large enough that numpy maps them lazily. A lazily mapped
    # mirror faults a page at a time inside the engine steps that first clear or
    # fill its slots; a new one must be mapped already.
    big = RowsFormat(num_layers=64, top_k=8, dtype="uint8", block_size=16)
    num_blocks = 48 * 2**20 // big.slot_nbytes
    assert _resident_fraction(RowsMirror(big, num_blocks).slots) > 0.99
    # Negative control: the measure sees a lazily mapped array of that size.
    lazy = np.zeros((num_blocks, big.slot_nbytes), np.uint8)
    assert _resident_fraction(lazy) < 0.1


def test_rows_that_do_not_cover_what_decode_needs_fail() -> None:
    mirror = _exported_mirror(start=6)  # prefill had rows from 6 on
    [check] = pulled_slot_checks(PROMPT, BS, 1, [6], rows_start=5, pull_end=8)
    assert mirror.slot_problem(check) == "rows of [2, 4), need [1, 4)"


def test_a_one_sided_switch_names_both_sides() -> None:
    check_peer_rows_format(fmt().describe(), fmt().describe(), "p0")
    with pytest.raises(RuntimeError) as error:
        check_peer_rows_format(fmt().describe(), "", "p0")
    assert "this instance v1 layers=3 top_k=2 dtype=uint8 block_size=4" in str(
        error.value
    )
    assert "the remote off" in str(error.value)
    assert "enable_routed_experts_transfer" in str(error.value)


# --- the round trip on real worker connectors ---------------------------------------


def _worker(mirror: RowsMirror) -> AuxOutputWorkerConnector:
    worker = bare_worker(RoutedExpertsBuffer(np.dtype(np.uint8), SHAPE, BS, 2, 16, 2))
    worker._rows_mirror = mirror
    return worker


def _step(
    worker: AuxOutputWorkerConnector,
    request_id: str,
    emit_start: int,
    token_start: int,
    step_rows: np.ndarray,
    num_hashes: int = 0,
    **transfers: dict,
) -> AuxRequestOutput:
    hashes = {}
    if num_hashes:
        data = b"".join(bytes([i]) * 32 for i in range(num_hashes))
        hashes = {request_id: PackedBlockHashes(data, 32)}
    metadata = AuxOutputConnectorMetadata(
        0, {request_id: emit_start}, hashes, (), **transfers
    )
    return run_step(worker, metadata, request_id, token_start, step_rows)[request_id]


def _decode_first_step(
    worker: AuxOutputWorkerConnector, emit_start: int, rows_import: RowsImport
) -> AuxRequestOutput:
    """Decode's first forward: it recomputes position 9 (its own row, 109) after
    importing `rows_import`; the prompt's two full blocks have their hashes."""
    return _step(
        worker,
        "d",
        emit_start,
        9,
        rows(9, 10, base=100),
        num_hashes=2,
        rows_imports={"d": rows_import},
    )


def _prefill(prompt_start: int) -> RowsMirror:
    """Prefill computes the 10-token prompt in two chunks and exports its rows
    into the slots of its blocks 5, 6, 7."""
    mirror = RowsMirror(fmt(), num_blocks=8)
    worker = _worker(mirror)
    chains = tuple(block_token_chains(PROMPT, BS))
    first = prompt_start // BS
    export = RowsExport(prompt_start, 10, (5, 6, 7)[first:], chains)
    _step(worker, "p", prompt_start, 0, rows(0, 6), num_hashes=2)
    assert mirror.slot_problem(SlotCheck(5, chains[0], 0, 1)) == (
        "no rows (tag not written by this format)"  # not yet: the prompt is not done
    )
    _step(worker, "p", prompt_start, 6, rows(6, 10), rows_exports={"p": export})
    return mirror


def _pull(prefill: RowsMirror, decode: RowsMirror, pairs: dict[int, int]) -> None:
    """What the NIXL READ does: remote slot -> local slot, bytes as they are."""
    for remote, local in pairs.items():
        decode.slots[local] = prefill.slots[remote]


def test_decode_returns_every_row_from_the_prompt_start() -> None:
    prefill = _prefill(prompt_start=0)
    decode = RowsMirror(fmt(), num_blocks=8)
    _pull(prefill, decode, {5: 1, 6: 2, 7: 3})
    for check in pulled_slot_checks(PROMPT, BS, 0, [1, 2, 3], 0, 10):
        assert decode.slot_problem(check) is None
    worker = _worker(decode)
    # The scheduler imports [0, 10); decode recomputes position 9 itself.
    out = _decode_first_step(worker, 0, RowsImport(0, 10, (1, 2, 3)))
    assert out.token_start == 0
    np.testing.assert_array_equal(
        out.rows, np.concatenate([rows(0, 9), rows(9, 10, 100)])
    )
    # Imported full blocks are decode's own now: published under its keys.
    keys = worker._requests["d"].aux_output_keys
    np.testing.assert_array_equal(
        np.frombuffer(worker._store.get_concatenated(keys[:2]), np.uint8).reshape(
            8, *SHAPE
        ),
        rows(0, 8),
    )
    # The next decode step emits only its own row.
    out = _step(worker, "d", 10, 10, rows(10, 11, base=100))
    assert out.token_start == 10
    np.testing.assert_array_equal(out.rows, rows(10, 11, 100))


def test_three_sources_line_up_by_position() -> None:
    # Decode holds blocks 0 and 4 from an earlier request, pulls block 8, recomputes 9.
    prefill = _prefill(prompt_start=0)
    decode = RowsMirror(fmt(), num_blocks=8)
    worker = _worker(decode)
    _step(worker, "earlier", 0, 0, rows(0, 8, base=50), num_hashes=2)
    worker.begin_step(AuxOutputConnectorMetadata(0, {}, {}, ("earlier",)))
    _pull(prefill, decode, {7: 3})
    out = _decode_first_step(worker, 0, RowsImport(8, 10, (3,)))
    assert out.token_start == 0
    np.testing.assert_array_equal(
        out.rows,
        np.concatenate([rows(0, 8, base=50), rows(8, 9), rows(9, 10, base=100)]),
    )


def test_a_prompt_start_mid_block_imports_from_there() -> None:
    prefill = _prefill(prompt_start=6)
    decode = RowsMirror(fmt(), num_blocks=8)
    _pull(prefill, decode, {6: 2, 7: 3})
    worker = _worker(decode)
    out = _decode_first_step(worker, 6, RowsImport(6, 10, (2, 3)))
    assert out.token_start == 6
    np.testing.assert_array_equal(
        out.rows, np.concatenate([rows(6, 9), rows(9, 10, 100)])
    )
    # Block 4 holds rows only from 6: it is never published.
    keys = worker._requests["d"].aux_output_keys
    with pytest.raises(Exception, match="does not exist"):
        worker._store.get_concatenated([keys[1]])


def export_after_a_mid_block_first_capture() -> list[str | None]:
    """Prefill's first forward starts at 6 (its first 6 tokens were loaded), so
    it holds no rows of [4, 8) (a partially computed first block is not staged)
    and cannot export [6, 10) into the slots of blocks 4 and 8: it writes
    nothing, and decode's checks find no rows there (decode recomputes them).
    Returns each slot's problem."""
    mirror = RowsMirror(fmt(), num_blocks=8)
    worker = _worker(mirror)
    chains = tuple(block_token_chains(PROMPT, BS))
    export = RowsExport(6, 10, (6, 7), chains[1:])
    # No block is keyed yet: the rows are read from the capture buffer.
    _step(worker, "p", 6, 6, rows(6, 10), rows_exports={"p": export})
    return [
        mirror.slot_problem(check)
        for check in pulled_slot_checks(PROMPT, BS, 1, [6, 7], 6, 10)
    ]


NOT_WRITTEN = "no rows (tag not written by this format)"


def test_an_export_of_rows_not_held_here_writes_nothing() -> None:
    assert export_after_a_mid_block_first_capture() == [NOT_WRITTEN] * 2


def test_an_export_of_rows_not_held_here_writes_nothing_under_dash_o() -> None:
    # Before, the export's reads relied on an assert: under ``python -O`` the
    # buffer returned rows of other positions.
    refused = json_under_dash_o(__file__, "export_after_a_mid_block_first_capture")
    assert refused == [NOT_WRITTEN] * 2


@pytest.mark.parametrize("corrupt", [False, True])
def test_the_mirror_reads_no_slot_that_fails_its_check(corrupt: bool) -> None:
    """The import carries each slot's check (import_checked_rows) and the
    mirror verifies them before it copies a row: a slot changed after the
    pull's check (here one flipped byte of block 4's rows) is refused, never
    returned. Control: the same slots untouched give every row."""
    prefill = _prefill(prompt_start=0)
    decode = RowsMirror(fmt(), num_blocks=8)
    _pull(prefill, decode, {5: 1, 6: 2, 7: 3})
    if corrupt:
        decode.slots[2, 0] ^= 0xFF
    rows_import = import_checked_rows(PROMPT, BS, 0, 10, (1, 2, 3))
    assert len(rows_import.checks) == 3
    if not corrupt:
        np.testing.assert_array_equal(decode.read(rows_import), rows(0, 10))
        return
    with pytest.raises(ValueError) as refused:
        decode.read(rows_import)
    assert str(refused.value) == (
        "routed-experts rows import [0, 10): the slot of block 2 failed its "
        "check: rows do not match their checksum"
    )
