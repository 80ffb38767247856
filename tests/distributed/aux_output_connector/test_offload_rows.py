"""The rows slots of offloaded chunks (patch
`carry-routed-experts-rows-with-offloaded-kv-chunks`).

Expected values come from the spec, not the code: token chains are derived here with
hashlib from the rule in rows_transfer.py's docstring (blake2b-64 over the previous
block's digest, seeded by a constant, and the block's token ids as int64), and slots
are written from tiny rows whose every value names its position. Each failure mode has
its own planted fault (other tokens, a flipped byte, a slot never written, a format
change), and the positive case shows the checks pass on the bytes they guard.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.dash_o import refused_under_dash_o
from tests.distributed.aux_output_connector.offload_rows_utils import (
    BS,
    FMT,
    TOKENS,
    rows_of_block,
)
from tests.rows_spec import RowsByHash, spec_chains
from vllm.distributed.aux_output_connector.offload_rows import (
    ChunkRowsCheck,
    ChunkRowsSource,
    OffloadedRowsIndex,
    OffloadedRowsSlots,
    offload_rows_layout_problem,
)
from vllm.distributed.aux_output_connector.rows_transfer import (
    RowsMirror,
    SlotCheck,
    block_token_chains,
    extend_block_token_chains,
)


def test_chains_follow_the_spec_and_extend_incrementally() -> None:
    expected = spec_chains(TOKENS, BS)
    assert block_token_chains(TOKENS, BS) == expected
    chains: list[int] = []
    extend_block_token_chains(chains, TOKENS, BS, 1)
    extend_block_token_chains(chains, TOKENS, BS, 3)
    assert chains == expected
    # Negative control: the production chains of a prompt with one token changed
    # (position 5, in block 1) differ from block 1 on, and the check above fails.
    changed = [5, 9, 13, 17, 21, 26, 29, 33, 37, 41]
    got = block_token_chains(changed, BS)
    assert got[0] == expected[0]
    assert got[1] != expected[1] and got[2] != expected[2]
    assert block_token_chains(changed, BS) != expected


def slots_with_two_chunks() -> tuple[OffloadedRowsSlots, RowsMirror, list[int]]:
    """Chunks 7 and 2 of the tier hold blocks 0 and 1 of TOKENS, stored with rows."""
    mirror = RowsMirror(FMT, num_blocks=6)
    slots = OffloadedRowsSlots(FMT, num_chunks=8, mirror=mirror)
    chains = spec_chains(TOKENS, BS)
    reader = RowsByHash({b"h0": rows_of_block(0), b"h1": rows_of_block(1)})
    stored = slots.write_stored(
        np.array([7, 2]),
        [
            ChunkRowsSource(0, (b"h0",), chains[0]),
            ChunkRowsSource(1, (b"h1",), chains[1]),
        ],
        reader,
    )
    assert stored == (0, 1)
    assert reader.calls == [(b"h0",), (b"h1",)]
    return slots, mirror, chains


def check(block_id: int, chain: int, lo: int = 0, hi: int = BS) -> SlotCheck:
    return SlotCheck(block_id=block_id, chain=chain, need_lo=lo, need_hi=hi)


def test_a_load_copies_the_rows_into_the_mirror_slots_of_its_kv_blocks() -> None:
    slots, mirror, chains = slots_with_two_chunks()
    failed_positions, failed_blocks = slots.import_loaded(
        np.array([7, 2]),
        [
            ChunkRowsCheck(0, check(3, chains[0], 1)),
            ChunkRowsCheck(1, check(5, chains[1])),
        ],
    )
    assert failed_positions == () and failed_blocks == set()
    assert (
        mirror.slots[3, : FMT.rows_nbytes].tolist() == rows_of_block(0).ravel().tolist()
    )
    assert (
        mirror.slots[5, : FMT.rows_nbytes].tolist() == rows_of_block(1).ravel().tolist()
    )
    assert not mirror.slots[[0, 1, 2, 4]].any()  # no other block's slot is touched


@pytest.mark.parametrize(
    ("fault", "problem"),
    [
        ("other tokens", "rows of other tokens"),
        ("flipped row byte", "do not match their checksum"),
        ("never written", "no rows"),
        ("format version", "no rows"),
    ],
)
def test_a_slot_that_does_not_hold_the_requests_rows_fails_its_block(
    fault: str, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    slots, mirror, chains = slots_with_two_chunks()
    chunk_ids = np.array([7, 2])
    expected_chain = chains[1]
    if fault == "other tokens":
        expected_chain = spec_chains([5, 9, 13, 17, 21, 26, 29, 33], BS)[1]
    elif fault == "flipped row byte":
        slots.slots.slots[2, 5] ^= 0xFF
    elif fault == "never written":
        chunk_ids = np.array([7, 4])  # chunk 4 was never stored with rows
    elif fault == "format version":
        slots.slots.slots[2, FMT.rows_nbytes] ^= 1  # the version half of word 0
    failed_positions, failed_blocks = slots.import_loaded(
        chunk_ids,
        [
            ChunkRowsCheck(0, check(3, chains[0])),
            ChunkRowsCheck(1, check(5, expected_chain)),
        ],
    )
    assert failed_positions == (1,)
    assert failed_blocks == {5}
    assert problem in caplog.text
    assert "failed their check" in caplog.text


def test_chunks_whose_rows_are_not_in_the_store_are_stored_with_an_empty_tag() -> None:
    mirror = RowsMirror(FMT, num_blocks=4)
    slots = OffloadedRowsSlots(FMT, num_chunks=4, mirror=mirror)
    slots.slots.slots[:] = 0xAB  # what an earlier, evicted chunk left behind
    chains = spec_chains(TOKENS, BS)
    reader = RowsByHash({b"h0": rows_of_block(0)})  # block 1's rows were evicted
    sources = [
        ChunkRowsSource(0, (b"h0",), chains[0]),
        ChunkRowsSource(1, (b"h1",), chains[1]),
    ]
    assert slots.write_stored(np.array([0, 1]), sources, reader) == (0,)
    assert not slots.slots.slots[1, FMT.rows_nbytes :].any()  # zero tag
    # And a process without an aux-output store (no reader) stores no rows at all.
    assert slots.write_stored(np.array([2, 3]), sources, None) == ()
    _, failed = slots.import_loaded(
        np.array([1]), [ChunkRowsCheck(0, check(0, chains[1]))]
    )
    assert failed == {0}


def test_rows_of_the_wrong_length_are_not_stored() -> None:
    """A chunk keyed by two hash blocks whose reader returns one block's rows."""
    mirror = RowsMirror(FMT, num_blocks=2)
    slots = OffloadedRowsSlots(FMT, num_chunks=2, mirror=mirror)
    reader = RowsByHash({b"a": rows_of_block(0)[:2]})
    assert (
        slots.write_stored(np.array([0]), [ChunkRowsSource(0, (b"a",), 1)], reader)
        == ()
    )


def test_the_index_learns_rows_from_store_reports_and_forgets_them() -> None:
    index = OffloadedRowsIndex(block_size=BS)
    hashes = [b"h0", b"h1", b"h2"]
    sources = index.store_started(
        job_id=4,
        request_id="r",
        token_ids=TOKENS,
        block_hashes=hashes,
        hashes_per_chunk=1,
        keys=[b"k2", b"k0"],  # the job's order is the manager's, not the request's
        chunk_indices=[2, 0],
    )
    chains = spec_chains(TOKENS, BS)
    assert sources == (
        ChunkRowsSource(0, (b"h2",), chains[2]),
        ChunkRowsSource(1, (b"h0",), chains[0]),
    )
    index.rows_stored(4, (1,))
    assert not index.has_rows(b"k0")  # not before every worker finished the job
    index.job_finished(4)
    assert index.has_rows(b"k0") and not index.has_rows(b"k2")

    # Stored again (after an eviction) without rows: the old bit does not survive.
    index.store_started(5, "r", TOKENS, hashes, 1, [b"k0"], [0])
    index.job_finished(5)
    assert not index.has_rows(b"k0")

    index.store_started(6, "r", TOKENS, hashes, 1, [b"k0", b"k1"], [0, 1])
    index.rows_stored(6, (0, 1))
    index.job_finished(6)
    index.load_started(7, [b"k1", b"k0"])
    index.rows_rejected(7, (0,))  # k1's rows failed a load check
    assert index.has_rows(b"k0") and not index.has_rows(b"k1")
    index.rows_rejected(99, (0,))  # a job from before a reset: ignored
    index.forget([b"k0"])  # evicted
    assert not index.has_rows(b"k0")
    index.store_started(8, "r", TOKENS, hashes, 1, [b"k0"], [0])
    index.rows_stored(8, (0,))
    index.job_finished(8)
    index.reset()
    assert not index.has_rows(b"k0")


def test_a_chunk_of_two_hash_blocks_reads_both() -> None:
    index = OffloadedRowsIndex(block_size=BS)
    sources = index.store_started(
        1, "r", TOKENS, [b"a", b"b", b"c", b"d"], 2, [b"k1"], [1]
    )
    assert sources[0].block_hashes == (b"c", b"d")


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (("CPUOffloadingSpec", 8, 1, 1, False, False), None),
        # Zero chunks still declares slots: the count is not the capability.
        (("CPUOffloadingSpec", 0, 1, 1, False, False), None),
        (
            ("ExampleOffloadingSpec", None, 1, 1, False, False),
            "ExampleOffloadingSpec keeps no rows slots",
        ),
        (("CPUOffloadingSpec", 8, 2, 1, False, False), "2 KV cache groups"),
        (("CPUOffloadingSpec", 8, 1, 4, False, False), "4 KV blocks"),
        (("CPUOffloadingSpec", 8, 1, 1, True, False), "sliding-window"),
        (("CPUOffloadingSpec", 8, 1, 1, False, True), "partial-tail"),
    ],
)
def test_layouts_rows_cannot_travel_with_are_named(
    args: tuple, problem: str | None
) -> None:
    found = offload_rows_layout_problem(*args)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_slot_writes_refuse_rows_that_do_not_fit_under_python_dash_o() -> None:
    setup = """
        import numpy as np
        from vllm.distributed.aux_output_connector.rows_transfer import (
            RowsFormat, RowsMirror)
        mirror = RowsMirror(RowsFormat(3, 2, "uint8", 4), num_blocks=4)
    """
    calls = {
        "rows past the block": "mirror.write_slot(1, 7, np.zeros((5, 3, 2), np.uint8))",
        "a block of another shape": (
            "mirror.write_whole_slots([1], [7], [np.zeros((3, 3, 2), np.uint8)])"
        ),
    }
    assert refused_under_dash_o(setup, calls) == list(calls)
