"""An OffloadingConnectorWorker whose routed-experts rows are under test: a real
worker whose spec and transfer worker are mocks, as upstream's worker tests build
it, storing two chunks of two blocks (tests/v1/kv_connector/unit/
test_offload_rows_async_stores.py, test_offload_rows_failed_jobs.py)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import MagicMock

from tests.rows_spec import RowsByHash, spec_chains
from vllm.distributed.aux_output_connector.offload_rows import (
    ChunkRowsSource,
    OffloadedRowsSlots,
)
from vllm.distributed.aux_output_connector.rows_transfer import RowsFormat, RowsMirror
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
LOAD_JOB = 8


def make_worker(async_scheduling: bool, reader: RowsByHash, instance_id: str):
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


def store_two_chunks(worker) -> None:
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


def poll(worker):
    worker.get_finished(set())
    return worker.build_connector_worker_meta()
