"""Lease generations (nixl/block_generations.py) on real host memory, for the lease
tests (test_nixl_lease_generations.py, test_nixl_lease_unchecked_reads.py,
test_load_failure_causes.py): a producer and a consumer over the `MemoryNixl`
stand-in, and the pull worker's lease-check state around them."""

from __future__ import annotations

from collections import defaultdict
from unittest.mock import MagicMock

from tests.v1.kv_connector.unit.nixl_memory import MemoryNixl
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.block_generations import (
    NixlBlockGenerations,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)


def pair(
    lands: bool = True, strided_descs: bool = False
) -> tuple[NixlBlockGenerations, NixlBlockGenerations]:
    """A producer with 8 blocks and a consumer with 10 that reads from it."""
    nixl = MemoryNixl(lands)
    producer = NixlBlockGenerations(nixl, ["UCX"], 8, strided_descs)
    consumer = NixlBlockGenerations(nixl, ["UCX"], 10, strided_descs)
    fields = producer.agent_metadata_fields()
    consumer.add_remote(
        "P",
        0,
        "agent-P",
        fields["block_generations_base_addr"],
        fields["block_generations_num_blocks"],
    )
    return producer, consumer


def stub_worker(generations: NixlBlockGenerations) -> NixlPullConnectorWorker:
    worker = object.__new__(NixlPullConnectorWorker)
    worker._block_generations = generations
    worker._recv_failures = set()
    worker._load_failure_causes = {}
    worker._recving_transfers = defaultdict(list)
    worker.xfer_stats = MagicMock()
    worker._log_failure = MagicMock()
    return worker
