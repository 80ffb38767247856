"""Offloaded chunks get their routed-experts rows under asynchronous scheduling
(patch `carry-routed-experts-rows-with-offloaded-kv-chunks`).

With asynchronous scheduling a step's rows are published when its output is
fetched, which may come after the next step's stores finished copying the step's
KV. The store job's completion then waits for the rows, through up to
ROWS_WAIT_POLLS more polls of `get_finished` (offload_rows.py's contract), and
reports the chunks with rows once they are written; rows that never come (an
evicted block) leave the chunk without rows after the last poll. With
synchronous scheduling every step's rows are published before its stores start,
so nothing waits. On a real OffloadingConnectorWorker whose spec and transfer
worker are mocks, as upstream's worker tests build it.
"""

from __future__ import annotations

import pytest

from tests.rows_spec import RowsByHash
from tests.rows_spec import rows_of_block as spec_rows_of_block
from tests.v1.kv_connector.unit.offload_rows_worker_utils import (
    BS,
    FMT,
    JOB,
    LOAD_JOB,
    TOKENS,
    make_worker,
    poll,
    store_two_chunks,
)
from vllm.distributed.aux_output_connector.offload_rows import (
    ROWS_WAIT_POLLS,
    ChunkRowsCheck,
)
from vllm.distributed.aux_output_connector.rows_transfer import pulled_slot_checks
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, TransferResult
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec


@pytest.fixture
def reader():
    # Block 0's rows are published; block 1's step output is not fetched yet.
    return RowsByHash({b"h0": spec_rows_of_block(0, BS)})


def test_async_completion_waits_for_rows_published_a_poll_later(reader) -> None:
    worker = make_worker(True, reader, "engine-async-late")
    store_two_chunks(worker)
    assert poll(worker) is None  # KV copied, rows of block 1 not yet there
    reader.publish({b"h1": spec_rows_of_block(1, BS)})
    meta = poll(worker)
    assert meta is not None
    assert meta.completed_jobs == {JOB: 1}
    assert meta.rows_stored == {JOB: (0, 1)}


def test_async_rows_that_never_come_end_the_wait_after_the_lastpoll(reader) -> None:
    worker = make_worker(True, reader, "engine-async-never")
    store_two_chunks(worker)
    # The poll that sees the copy finish, then ROWS_WAIT_POLLS more: the last one
    # stores what is there.
    for _ in range(ROWS_WAIT_POLLS):
        assert poll(worker) is None
    meta = poll(worker)
    assert meta is not None
    assert meta.completed_jobs == {JOB: 1}
    assert meta.rows_stored == {JOB: (0,)}
    assert poll(worker) is None  # completed once


def test_sync_completion_never_waits(reader) -> None:
    worker = make_worker(False, reader, "engine-sync")
    store_two_chunks(worker)
    meta = poll(worker)
    assert meta is not None
    assert meta.completed_jobs == {JOB: 1}
    assert meta.rows_stored == {JOB: (0,)}
    written = worker._rows.slots.slots
    assert written[2, FMT.rows_nbytes :].any()  # chunk 2 holds block 0's rows
    assert not written[3, FMT.rows_nbytes :].any()  # chunk 3 an empty tag


def test_a_load_whose_rows_fail_their_check_says_why(reader) -> None:
    """Chunk 3 of the store holds an empty tag (block 1's rows never came): a load
    of chunks 2 and 3 into blocks 0 and 1 fails block 1, and its request's
    error names the cause (get_load_failure_causes); chunk 2 passes."""
    worker = make_worker(False, reader, "engine-load-check")
    store_two_chunks(worker)
    assert poll(worker) is not None
    checks = pulled_slot_checks(TOKENS, BS, 0, [0, 1], 0, len(TOKENS))
    load = TransferJob(
        req_id="loader",
        src_spec=CPULoadStoreSpec([2, 3]),
        dst_spec=GPULoadStoreSpec([0, 1], group_sizes=(2,), block_indices=(0,)),
        rows_checks=tuple(ChunkRowsCheck(i, c) for i, c in enumerate(checks)),
    )
    worker.worker.get_finished.side_effect = [[TransferResult(LOAD_JOB, True)]]
    worker.start_kv_transfers(
        OffloadingConnectorMetadata(load_jobs={LOAD_JOB: load}, store_jobs={})
    )
    worker.get_finished(set())
    assert worker.take_rows_load_errors() == {1}
    assert worker.take_rows_load_failure_causes() == {
        "loader": "the routed-experts rows of its offloaded KV chunks failed their "
        "check"
    }
    assert worker.take_rows_load_failure_causes() == {}
