# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Store lookups that end before chunks whose load failed.

The store's lookup (``batch_is_exist``) may say a chunk exists while its get
fails (e.g. -704 OBJECT_NOT_FOUND). With ``kv_load_failure_policy=recompute``
the Scheduler then truncates the request at the failed block. When that leaves
the request nothing computed (the failed block was its first, or the worker
reported the whole load failed), the request is looked up again, the store still
says the chunk exists, the load fails again, and the request never finishes.

So the scheduler side remembers which blocks each request is loading and learns
from the connector output which of them failed:

- that request's later lookups end before its first failed chunk, so each of
  its loads that fails ends its lookups lower, and it finishes;
- the failed chunk's hash is remembered for a while (bounded), so other
  requests' lookups end before it too instead of each failing on it once.
"""

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    LoadSpec,
)
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.core.kv_cache_utils import BlockHash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

logger = init_logger(__name__)

# How many failed chunks are remembered, and for how long: long enough for the
# requests queued behind a broken chunk to skip it, short enough that a chunk
# the recompute stores again soon counts again.
FAILED_CHUNKS_CAPACITY = 4096
FAILED_CHUNK_TTL_S = 60.0


@dataclass
class _Load:
    """A load set up for a request: its token range and, in single-group
    layouts, the block index of each destination block id."""

    request: Request
    start: int
    end: int
    block_index: dict[int, int]


class StoreLoadFailures:
    """Where the store lookups of MooncakeStoreScheduler end after failed loads."""

    def __init__(
        self,
        block_size: int,
        hash_block_size: int,
        capacity: int = FAILED_CHUNKS_CAPACITY,
        ttl_s: float = FAILED_CHUNK_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.clock = clock
        # Loads in flight, by request id.
        self.loads: dict[str, _Load] = {}
        # Request id -> the token its lookups end at, for unfinished requests.
        self.caps: dict[str, int] = {}
        # Hash of a failed chunk's key -> when it counts again, oldest first.
        self.failed_chunks: OrderedDict[BlockHash, float] = OrderedDict()

    def cap_lookup(
        self,
        request: Request,
        block_hashes: list[BlockHash] | None,
        num_computed_tokens: int,
    ) -> list[BlockHash] | None:
        """The hashes to look up, ending before the request's first failed chunk
        and before any remembered failed chunk. None when nothing is left past
        ``num_computed_tokens``, as then no lookup can add a hit."""
        if block_hashes is None:
            return None
        cap = self.caps.get(request.request_id)
        chunk_cap = self._failed_chunk_start(block_hashes)
        if chunk_cap is not None:
            logger.debug(
                "Mooncake store lookup of request %s ends at token %d, before "
                "a chunk whose load failed",
                request.request_id,
                chunk_cap,
            )
            cap = chunk_cap if cap is None else min(cap, chunk_cap)
        if cap is None or cap >= len(block_hashes) * self.hash_block_size:
            return block_hashes
        if cap <= num_computed_tokens:
            return None
        return block_hashes[: cap // self.hash_block_size]

    def record_load(
        self, request: Request, block_ids: tuple[list[int], ...], load_spec: LoadSpec
    ) -> None:
        """Remember the blocks a load just set up writes (update_state_after_alloc).

        The worker loads from the block holding ``vllm_cached_tokens``. Block ids
        name blocks only in single-group layouts; others report failures by
        request (failed_recving)."""
        start = load_spec.vllm_cached_tokens // self.block_size * self.block_size
        end = load_spec.kvpool_cached_tokens
        block_index: dict[int, int] = {}
        if len(block_ids) == 1:
            (group,) = block_ids
            for index in range(start // self.block_size, cdiv(end, self.block_size)):
                if index < len(group) and group[index] != NULL_BLOCK_ID:
                    block_index[group[index]] = index
        self.loads[request.request_id] = _Load(request, start, end, block_index)

    def learn(self, connector_output: KVConnectorOutput) -> None:
        """Cap the lookups of requests whose load failed; forget finished loads."""
        invalid = connector_output.invalid_block_ids
        failed_recving = connector_output.failed_recving
        if invalid or failed_recving:
            for req_id, load in self.loads.items():
                failed = [i for b, i in load.block_index.items() if b in invalid]
                if failed:
                    self._load_failed(req_id, load, min(failed))
                elif req_id in failed_recving:
                    self._load_failed(req_id, load, None)
        for req_id in connector_output.finished_recving or ():
            self.loads.pop(req_id, None)

    def forget(self, scheduler_output: SchedulerOutput) -> None:
        """Drop the state of finished requests, and the loads of preempted ones
        (their blocks are freed)."""
        self._forget(scheduler_output.finished_req_ids, caps=True)
        self._forget(scheduler_output.preempted_req_ids or (), caps=False)

    def remember(self, chunk_hash: BlockHash) -> None:
        """Make other requests' lookups end before this chunk for ``ttl_s``."""
        self.failed_chunks[chunk_hash] = self.clock() + self.ttl_s
        self.failed_chunks.move_to_end(chunk_hash)
        while len(self.failed_chunks) > self.capacity:
            self.failed_chunks.popitem(last=False)

    def _forget(self, req_ids: Iterable[str], caps: bool) -> None:
        for req_id in req_ids:
            self.loads.pop(req_id, None)
            if caps:
                self.caps.pop(req_id, None)

    def _load_failed(self, req_id: str, load: _Load, index: int | None) -> None:
        """Block ``index`` of the request failed to load; None: an unknown one."""
        if index is None:
            position = load.start
        else:
            position = index * self.block_size
            # A chunk is stored under the hash of its last hash block.
            chunk_end = min(position + self.block_size, load.end)
            hashes = load.request.block_hashes
            if 0 < chunk_end // self.hash_block_size <= len(hashes):
                self.remember(hashes[chunk_end // self.hash_block_size - 1])
        if position >= self.caps.get(req_id, load.end):
            return
        self.caps[req_id] = position
        logger.warning(
            "Mooncake store: the KV load of request %s failed at token %d; its "
            "lookups now end there%s.",
            req_id,
            position,
            ""
            if index is None
            else f", and other requests' end before that chunk for {self.ttl_s:g} s",
        )

    def _failed_chunk_start(self, block_hashes: list[BlockHash]) -> int | None:
        """The first token of the first remembered failed chunk among the hashes."""
        failed = self.failed_chunks
        now = self.clock()
        while failed and next(iter(failed.values())) <= now:
            failed.popitem(last=False)
        if not failed:
            return None
        for index, block_hash in enumerate(block_hashes):
            if block_hash in failed:
                start = index * self.hash_block_size
                return start // self.block_size * self.block_size
        return None
