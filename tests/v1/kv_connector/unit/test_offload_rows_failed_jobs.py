"""Offloaded chunks whose KV copy failed keep no routed-experts rows state (patch
`carry-routed-experts-rows-with-offloaded-kv-chunks`, vLLM 0.34.0's shape).

vLLM 0.34.0's offloading worker reports a failed transfer job to the scheduler and
goes on; the rows of a failed store are not written and those of a failed load not
imported, and neither job's rows state outlives it. vLLM 0.31.0's worker asserts
that every transfer succeeded, so there a failed job ends the engine and no rows
state can outlive it: the 0.31.0 series does not list this file.
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
from vllm.distributed.aux_output_connector.offload_rows import ChunkRowsCheck
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


def test_failed_jobs_keep_no_rows_state(reader) -> None:
    """A store and a load whose KV copy failed: their rows are neither written
    nor imported, and nothing of them stays behind (before, each failed job
    left its entry for the worker's lifetime)."""
    worker = make_worker(False, reader, "engine-failed-jobs")
    store_two_chunks(worker)
    worker.worker.get_finished.side_effect = [[TransferResult(JOB, False)]]
    meta = poll(worker)
    assert meta.completed_jobs == {JOB: 1} and meta.failed_jobs == {JOB}
    assert meta.rows_stored == {}
    load = TransferJob(
        req_id="loader",
        src_spec=CPULoadStoreSpec([2, 3]),
        dst_spec=GPULoadStoreSpec([0, 1], group_sizes=(2,), block_indices=(0,)),
        rows_checks=(
            ChunkRowsCheck(0, pulled_slot_checks(TOKENS, BS, 0, [0], 0, 4)[0]),
        ),
    )
    worker.start_kv_transfers(
        OffloadingConnectorMetadata(load_jobs={LOAD_JOB: load}, store_jobs={})
    )
    worker.worker.get_finished.side_effect = [[TransferResult(LOAD_JOB, False)]]
    assert worker.get_finished(set()) == (set(), {"loader"})
    assert worker._rows_stores == {} and worker._rows_loads == {}
    assert worker.take_rows_load_errors() == set()
    assert not worker._rows.slots.slots[:, FMT.rows_nbytes :].any()
