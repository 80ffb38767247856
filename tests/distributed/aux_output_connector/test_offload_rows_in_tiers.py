"""Rows slots inside the shared region's chunk rows, so that secondary tiers and
restarts carry them (patch `carry-routed-experts-rows-through-secondary-offload`).

A chunk row here is 64 bytes of KV (every byte 0xAB), a 48-byte rows slot (4
positions x 2 layers x top-2, uint8, then the 32-byte tag) and 16 bytes of padding.
Expected bytes come from the spec: the rows as written, the chain derived with
hashlib (tests.rows_spec.spec_chains), the crc32 of the rows; the tag's first word
is compared with a slot the plain host array wrote (the same format in two places).
The scheduler's check is shown passing on a copied slot (a promotion from a file, as
the offloading manager reports it) and failing on each planted fault: other tokens,
zeroed bytes, a flipped byte.
"""

from __future__ import annotations

import zlib

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
    ChunkRowsSource,
    OffloadedRowsIndex,
    OffloadedRowsSlots,
    chunk_trailer_slots,
    offload_rows_layout_problem,
    slot_has_rows,
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


def _slot(row: bytes) -> bytes:
    """The rows slot of a chunk row, as the manager reports a promoted chunk's
    trailer (the bytes a tier copied from a file)."""
    return row[KV_BYTES : KV_BYTES + SLOT]


def test_a_promoted_chunk_is_judged_by_its_slot() -> None:
    stored = _region()
    _store_block_0(stored, chunk=0)
    chains = spec_chains(TOKENS, BS)
    slot = _slot(stored[0].tobytes())
    assert slot_has_rows(FMT, slot, chains[0]) is True
    # Planted faults: the rows of other tokens; a slot never written; a flipped byte.
    assert slot_has_rows(FMT, slot, chains[1]) is False
    assert slot_has_rows(FMT, bytes(SLOT), chains[0]) is False
    flipped = bytearray(slot)
    flipped[3] ^= 1
    assert slot_has_rows(FMT, bytes(flipped), chains[0]) is False


def test_the_index_judges_a_promoted_chunk_when_asked() -> None:
    stored = _region()
    _store_block_0(stored, chunk=0)
    index = OffloadedRowsIndex(BS, promoted_format=FMT)
    # Not promoted, no store reported it: maybe in a secondary tier.
    assert index.chunk_has_rows(b"k0", "r", TOKENS, 0) is None
    index.note_promoted(b"k0", _slot(stored[0].tobytes()))
    assert index.chunk_has_rows(b"k0", "r", TOKENS, 1) is False  # block 1's tokens
    assert index.chunk_has_rows(b"k0", "r", TOKENS, 0) is True
    assert index.has_rows(b"k0")  # remembered
    # Promoted again with a slot that fails: its rows are judged anew.
    index.note_promoted(b"k0", bytes(SLOT))
    assert not index.has_rows(b"k0")
    assert index.chunk_has_rows(b"k0", "r", TOKENS, 0) is False
    # Evicted: unknown again.
    index.forget([b"k0"])
    assert index.chunk_has_rows(b"k0", "r", TOKENS, 0) is None
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
