"""Rows slots inside the shared region's chunk rows, so that secondary tiers and
restarts carry them (patch `carry-routed-experts-rows-through-secondary-offload`).

A chunk row here is 64 bytes of KV (every byte 0xAB), a 48-byte rows slot (4
positions x 2 layers x top-2, uint8, then the 32-byte tag) and 16 bytes of padding.
Expected bytes come from the spec: the rows as written, the chain derived with
hashlib (test_offload_rows.spec_chains), the crc32 of the rows; the tag's first word
is compared with a slot the plain host array wrote (the same format in two places).
The scheduler's check is shown passing on a copied row (a promotion from a file) and
failing on each planted fault: other tokens, zeroed bytes, a flipped byte.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_offload_rows import BS, FMT, TOKENS, rows_of_block

from tests.dash_o import refused_under_dash_o
from tests.rows_spec import RowsByHash, spec_chains
from vllm.distributed.aux_output_connector.offload_rows import (
    ChunkRowsSource,
    OffloadedRowsIndex,
    OffloadedRowsSlots,
    ResidentChunkRows,
    chunk_trailer_slots,
    offload_rows_layout_problem,
)
from vllm.distributed.aux_output_connector.rows_transfer import RowsMirror

KV_BYTES, SLOT, PAD = 64, 48, 16
ROW = KV_BYTES + SLOT + PAD


def _region(num_chunks: int = 3) -> np.ndarray:
    rows = np.zeros((num_chunks, ROW), np.uint8)
    rows[:, :KV_BYTES] = 0xAB
    return rows


def _store_block_0(region: np.ndarray, chunk: int) -> None:
    slots = OffloadedRowsSlots(
        FMT,
        len(region),
        RowsMirror(FMT, 2),
        chunk_trailer_slots(region, KV_BYTES, SLOT),
    )
    source = ChunkRowsSource(0, (b"h0",), spec_chains(TOKENS, BS)[0])
    reader = RowsByHash({b"h0": rows_of_block(0)})
    stored = slots.write_stored([chunk], [source], reader)
    assert stored == (0,)


def test_the_slot_lands_after_the_kv_of_its_chunk_row() -> None:
    assert FMT.slot_nbytes == SLOT
    region = _region()
    _store_block_0(region, chunk=2)
    rows = rows_of_block(0).reshape(-1)
    assert (region[2, KV_BYTES : KV_BYTES + 16] == rows).all()
    tag = region[2, KV_BYTES + 16 : KV_BYTES + SLOT].view(np.uint64)
    plain = RowsMirror(FMT, 1)
    plain.write_whole_slots([0], [spec_chains(TOKENS, BS)[0]], [rows_of_block(0)])
    assert int(tag[0]) == int(plain.slots[0, 16:].view(np.uint64)[0])  # magic|version
    assert int(tag[1]) == BS  # positions [0, 4)
    assert int(tag[2]) == spec_chains(TOKENS, BS)[0]
    assert int(tag[3]) == zlib.crc32(rows.tobytes())
    # The KV, the padding and the other chunks' rows are untouched.
    assert (region[:, :KV_BYTES] == 0xAB).all()
    assert (region[:, KV_BYTES + SLOT :] == 0).all()
    assert (region[:2, KV_BYTES:] == 0).all()


def test_a_slot_that_does_not_fit_the_row_is_refused() -> None:
    with pytest.raises(
        ValueError, match="48 B at offset 100 does not fit a chunk row of 128 B"
    ):
        chunk_trailer_slots(_region(), 100, SLOT)


class ReadyChunks:
    """The CPU tier's ready chunks by key; counts the questions."""

    def __init__(self, chunks: dict[bytes, int]) -> None:
        self.chunks = chunks
        self.asked: list[bytes] = []

    def __call__(self, key: bytes) -> int | None:
        self.asked.append(key)
        return self.chunks.get(key)


def _promoted(row: bytes) -> np.ndarray:
    """A new process's region whose chunk 1 a tier filled from a file's bytes."""
    region = np.zeros((2, ROW), np.uint8)
    region[1] = np.frombuffer(row, np.uint8)
    return region


def test_a_promoted_chunk_is_known_by_its_slot() -> None:
    stored = _region()
    _store_block_0(stored, chunk=0)
    chains = spec_chains(TOKENS, BS)
    ready = ReadyChunks({b"k0": 1})
    resident = ResidentChunkRows(FMT, _promoted(stored[0].tobytes()), KV_BYTES, ready)
    assert resident.has_rows(b"k0", chains[0]) is True
    # Planted faults: the rows of other tokens; a slot never written; a flipped byte.
    assert resident.has_rows(b"k0", chains[1]) is False
    zeroed = ResidentChunkRows(FMT, _promoted(bytes(ROW)), KV_BYTES, ready)
    assert zeroed.has_rows(b"k0", chains[0]) is False
    flipped = bytearray(stored[0].tobytes())
    flipped[KV_BYTES + 3] ^= 1
    corrupt = ResidentChunkRows(FMT, _promoted(bytes(flipped)), KV_BYTES, ready)
    assert corrupt.has_rows(b"k0", chains[0]) is False
    # Not (yet) in the CPU tier: only a secondary tier can say.
    assert resident.has_rows(b"elsewhere", chains[0]) is None


def test_the_index_asks_the_region_only_for_chunks_no_store_reported() -> None:
    stored = _region()
    _store_block_0(stored, chunk=0)
    ready = ReadyChunks({b"k0": 1})
    resident = ResidentChunkRows(FMT, _promoted(stored[0].tobytes()), KV_BYTES, ready)
    index = OffloadedRowsIndex(BS, resident)
    assert index.chunk_has_rows(b"missing", "r", TOKENS, 0) is None
    assert index.chunk_has_rows(b"k0", "r", TOKENS, 1) is False  # block 1's tokens
    assert index.chunk_has_rows(b"k0", "r", TOKENS, 0) is True
    assert index.has_rows(b"k0")  # remembered: not read again
    asked = len(ready.asked)
    assert index.chunk_has_rows(b"k0", "r", TOKENS, 0) is True
    assert len(ready.asked) == asked
    # Without secondary tiers only what stores reported counts.
    assert OffloadedRowsIndex(BS).chunk_has_rows(b"k0", "r", TOKENS, 0) is False


def test_the_tiering_spec_is_a_layout_rows_travel_with() -> None:
    assert (
        offload_rows_layout_problem("TieringOffloadingSpec", 8, 1, 1, False, False)
        is None
    )
    # Its secondary tiers do not lift the other limits.
    problem = offload_rows_layout_problem(
        "TieringOffloadingSpec", 8, 1, 4, False, False
    )
    assert problem == "a chunk holds 4 KV blocks, not one"


def test_a_mirror_over_slots_of_another_shape_is_refused_under_python_dash_o() -> None:
    setup = """
        import numpy as np
        from vllm.distributed.aux_output_connector.rows_transfer import (
            RowsFormat, RowsMirror)
        fmt = RowsFormat(3, 2, "uint8", 4)
        mirror = RowsMirror(fmt, num_blocks=4)
    """
    calls = {
        "slots of another shape": (
            "RowsMirror(fmt, 4, np.zeros((4, fmt.slot_nbytes - 1), np.uint8))"
        ),
        "slots of another format": (
            "mirror.copy_slots(RowsMirror(RowsFormat(3, 2, 'uint8', 8), 4), [0], [0])"
        ),
    }
    assert refused_under_dash_o(setup, calls) == list(calls)
