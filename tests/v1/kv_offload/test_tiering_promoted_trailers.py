"""A tiering manager reports each chunk a secondary tier promoted, with the
bytes after its KV (patch `carry-routed-experts-rows-through-secondary-offload`):
the offloading connector's scheduler judges routed-experts rows slots from this
report instead of reading the region itself.

Real objects throughout: a shared offload region, the primary tier, the tiering
manager, and a secondary tier that, like a file tier after a restart, holds a
chunk it writes into the primary tier's row when it promotes it. The expected
bytes are the ones the tier wrote.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import numpy as np
import pytest

from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

ROW = mmap.PAGESIZE
TRAILER = (ROW - 64, 48)  # offset and size of the bytes after the KV
KEY = make_offload_key(b"block-0", 0)
CTX = ReqContext(req_id="r")


class RowsFromFiles(ExampleSecondaryTierManager):
    """Holds whole chunk rows and writes one into the primary tier's row when
    it promotes it, as a file tier reads a chunk back."""

    def __init__(self, primary_kv_view: memoryview, rows: dict[bytes, bytes]) -> None:
        super().__init__(None, primary_kv_view, "files")  # type: ignore[arg-type]
        self._view = np.asarray(primary_kv_view)
        self._rows = rows
        self.chunks.update(dict.fromkeys(rows, True))

    def submit_load(self, job_metadata: TransferJob) -> None:
        for key, chunk in zip(job_metadata.keys, job_metadata.chunk_ids):
            self._view[int(chunk)] = np.frombuffer(self._rows[key], np.uint8)
        super().submit_load(job_metadata)


def _row() -> bytes:
    row = bytearray(ROW)
    row[: TRAILER[0]] = b"\xab" * TRAILER[0]  # the KV
    row[TRAILER[0] : TRAILER[0] + TRAILER[1]] = bytes(range(1, TRAILER[1] + 1))
    return bytes(row)


@pytest.fixture
def region() -> Iterator[SharedOffloadRegion]:
    region = SharedOffloadRegion(
        engine_id="test-promoted-trailers",
        num_chunks=4,
        rank=None,
        kv_bytes_per_chunk=ROW,
        cpu_page_size=ROW,
    )
    yield region
    region.cleanup()


def _promote(region: SharedOffloadRegion, trailer: tuple[int, int] | None):
    primary = CPUPrimaryTierOffloadingManager(
        num_chunks=4, mmap_region=region, block_trailer=trailer
    )
    tier = RowsFromFiles(primary.get_kv_memoryview(), {KEY: _row()})
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    manager.on_new_request(CTX)
    # Not in the CPU tier: the lookup starts a promotion, which the step's end
    # submits; the next step's lookup completes it.
    assert manager.lookup(KEY, CTX) is not LookupResult.HIT
    assert manager.take_promoted_trailers() == []
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=["r"], preempted_req_ids=()))
    assert manager.lookup(KEY, CTX) is LookupResult.HIT
    return manager


def test_a_promoted_chunk_is_reported_with_its_trailer(
    region: SharedOffloadRegion,
) -> None:
    manager = _promote(region, TRAILER)
    assert manager.promotes_chunks
    assert manager.take_promoted_trailers() == [(KEY, bytes(range(1, 49)))]
    # Taken once.
    assert manager.take_promoted_trailers() == []
    manager.shutdown()


def test_without_trailers_a_promotion_reports_nothing(
    region: SharedOffloadRegion,
) -> None:
    """Negative control: the same promotion, chunks without trailers."""
    manager = _promote(region, None)
    assert manager.take_promoted_trailers() == []
    manager.shutdown()
