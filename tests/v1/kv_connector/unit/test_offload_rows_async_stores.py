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

from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

from tests.fork_base import BASE_RELEASE
from tests.rows_spec import RowsByHash, spec_chains
from tests.rows_spec import rows_of_block as spec_rows_of_block
from vllm.distributed.aux_output_connector.offload_rows import (
    ROWS_WAIT_POLLS,
    ChunkRowsCheck,
    ChunkRowsSource,
    OffloadedRowsSlots,
)
from vllm.distributed.aux_output_connector.rows_transfer import (
    RowsFormat,
    RowsMirror,
    pulled_slot_checks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingSpec, TransferResult
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

BS = 4
FMT = RowsFormat(num_layers=2, top_k=2, dtype="uint8", block_size=BS)
TOKENS = [5, 9, 13, 17, 21, 25, 29, 33]  # two full blocks
JOB = 7


def _worker(async_scheduling: bool, reader: RowsByHash, instance_id: str):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    spec = MagicMock(spec=OffloadingSpec)
    spec.replicated_layout = True
    spec.config = MagicMock()
    spec.config.canonical_layout = False
    spec.config.parallel.rank = 0
    vllm_config = MagicMock()
    vllm_config.instance_id = instance_id
    vllm_config.parallel_config.tensor_parallel_size = 1
    vllm_config.parallel_config.world_size = 1
    vllm_config.parallel_config.rank = 0
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    worker = OffloadingConnectorWorker(
        spec=spec,
        vllm_config=vllm_config,
        kv_cache_config=KVCacheConfig(
            num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[]
        ),
    )
    worker.worker = MagicMock()
    # The device KV caches vLLM 0.34.0 resolves copy pointers from: one group
    # without layers, so the copy has no descriptors (the rows are under test).
    worker._kv_caches = SimpleNamespace(group_data_refs=[[]])
    # The output rank's slots (what _init_worker builds when rows travel).
    worker._rows = OffloadedRowsSlots(FMT, num_chunks=4, mirror=RowsMirror(FMT, 4))
    # What OffloadingConnector.set_aux_output_worker hands the worker: here a
    # reader of published rows by block hash.
    worker.aux_output_worker = reader
    return worker


def _store_two_chunks(worker) -> None:
    chains = spec_chains(TOKENS, BS)
    job = TransferJob(
        req_id="req",
        src_spec=GPULoadStoreSpec([0, 1], group_sizes=(2,), block_indices=(0,)),
        dst_spec=CPULoadStoreSpec([2, 3]),
        rows_sources=(
            ChunkRowsSource(0, (b"h0",), chains[0]),
            ChunkRowsSource(1, (b"h1",), chains[1]),
        ),
    )
    worker.prepare_store_kv(
        OffloadingConnectorMetadata(load_jobs={}, store_jobs={JOB: job})
    )
    worker.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    # The KV copy finishes at once (a host copy); later polls report nothing new.
    worker.worker.get_finished.side_effect = [[TransferResult(JOB, True)]] + [[]] * 9


def _poll(worker):
    worker.get_finished(set())
    return worker.build_connector_worker_meta()


@pytest.fixture
def reader():
    # Block 0's rows are published; block 1's step output is not fetched yet.
    return RowsByHash({b"h0": spec_rows_of_block(0, BS)})


def test_async_completion_waits_for_rows_published_a_poll_later(reader) -> None:
    worker = _worker(True, reader, "engine-async-late")
    _store_two_chunks(worker)
    assert _poll(worker) is None  # KV copied, rows of block 1 not yet there
    reader.publish({b"h1": spec_rows_of_block(1, BS)})
    meta = _poll(worker)
    assert meta is not None
    assert meta.completed_jobs == {JOB: 1}
    assert meta.rows_stored == {JOB: (0, 1)}


def test_async_rows_that_never_come_end_the_wait_after_the_last_poll(reader) -> None:
    worker = _worker(True, reader, "engine-async-never")
    _store_two_chunks(worker)
    # The poll that sees the copy finish, then ROWS_WAIT_POLLS more: the last one
    # stores what is there.
    for _ in range(ROWS_WAIT_POLLS):
        assert _poll(worker) is None
    meta = _poll(worker)
    assert meta is not None
    assert meta.completed_jobs == {JOB: 1}
    assert meta.rows_stored == {JOB: (0,)}
    assert _poll(worker) is None  # completed once


def test_sync_completion_never_waits(reader) -> None:
    worker = _worker(False, reader, "engine-sync")
    _store_two_chunks(worker)
    meta = _poll(worker)
    assert meta is not None
    assert meta.completed_jobs == {JOB: 1}
    assert meta.rows_stored == {JOB: (0,)}
    written = worker._rows.slots.slots
    assert written[2, FMT.rows_nbytes :].any()  # chunk 2 holds block 0's rows
    assert not written[3, FMT.rows_nbytes :].any()  # chunk 3 an empty tag


LOAD_JOB = 8


def test_a_load_whose_rows_fail_their_check_says_why(reader) -> None:
    """Chunk 3 of the store holds an empty tag (block 1's rows never came): a load
    of chunks 2 and 3 into blocks 0 and 1 fails block 1, and its request's
    error names the cause (get_load_failure_causes); chunk 2 passes."""
    worker = _worker(False, reader, "engine-load-check")
    _store_two_chunks(worker)
    assert _poll(worker) is not None
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


@pytest.mark.skipif(
    BASE_RELEASE == "0.31.0",
    reason="vLLM 0.31.0's offloading worker asserts that every transfer "
    "succeeded: a failed job ends the engine there, so no rows state outlives it",
)
def test_failed_jobs_keep_no_rows_state(reader) -> None:
    """A store and a load whose KV copy failed: their rows are neither written
    nor imported, and nothing of them stays behind (before, each failed job
    left its entry for the worker's lifetime)."""
    worker = _worker(False, reader, "engine-failed-jobs")
    _store_two_chunks(worker)
    worker.worker.get_finished.side_effect = [[TransferResult(JOB, False)]]
    meta = _poll(worker)
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
