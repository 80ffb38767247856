"""A real `AuxOutputWorkerConnector` without a model, and one step through it
(begin_step -> prepare_output -> process_output), for the worker tests."""

from __future__ import annotations

from threading import Lock
from types import SimpleNamespace
from unittest.mock import Mock

import numpy as np
import torch

from vllm.distributed.aux_output_connector.connector import (
    AuxOutputConnectorMetadata,
    AuxRequestOutput,
)
from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer
from vllm.distributed.aux_output_connector.store import BlockObjectStore
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector


def bare_worker(buffer: RoutedExpertsBuffer) -> AuxOutputWorkerConnector:
    """The output rank's worker connector around `buffer`, with a store of 64 blocks;
    its capturer is a Mock whose snapshot `run_step` sets."""
    block_nbytes = buffer.block_size * int(np.prod(buffer.shape_per_token))
    block_nbytes *= buffer.dtype.itemsize
    worker = object.__new__(AuxOutputWorkerConnector)
    worker._store = BlockObjectStore(
        max_bytes=64 * block_nbytes, object_nbytes=block_nbytes
    )
    worker._buffer = buffer
    worker._requests = {}
    worker._generation = 0
    worker._outputs_committed = 0
    worker._step_metadata = None
    worker._pending_outputs = []
    worker._lock = Lock()
    worker._max_concurrent_batches = 2
    worker._capturer = Mock()
    return worker


def run_step(
    worker: AuxOutputWorkerConnector,
    metadata: AuxOutputConnectorMetadata,
    request_id: str,
    token_start: int,
    step_rows: np.ndarray,
) -> dict[str, AuxRequestOutput]:
    """One step of one request that computed `step_rows` from `token_start` on
    and sampled one token."""
    worker.begin_step(metadata)
    worker._capturer.snapshot_routing_data.return_value = torch.from_numpy(step_rows)
    batch = SimpleNamespace(
        req_ids=[request_id],
        query_start_loc_np=np.array([0, len(step_rows)], dtype=np.int32),
        num_computed_tokens_np=np.array([token_start], dtype=np.int32),
    )
    pending = worker.prepare_output(batch)
    assert pending is not None
    pending.enqueue_cpu_copy(np.array([1]), np.array([0]))
    return pending.process_output()
