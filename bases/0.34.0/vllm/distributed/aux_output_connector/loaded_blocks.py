# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scheduler-side record of KV blocks filled by external loads.

Contract:
- A block whose KV came from a KV-connector load (KV offload, a NIXL pull)
  has no auxiliary rows: rows are only produced by a local forward. Once the
  load lands the block is cached, and later requests reach it as a plain
  local prefix hit that no connector load limit sees.
- ``AuxOutputSchedulerConnector`` records every loaded block (async loads
  when they land), called by the scheduler. ``AuxOutputSchedulerConnector`` treats a
  recorded block as rowless: ``max_cache_hit`` stops at it (so neither a
  local hit nor an external load is accepted past it where rows are needed)
  and ``request_finished`` does not retain it. The cut tokens are recomputed
  locally, which publishes their rows.
- Records are keyed by block id and hold the block's cache hash at the load,
  so there are never more records than KV-cache blocks. A record counts while
  the block still has that hash; once the block is reallocated (its hash
  changes) the record is stale and is replaced by the next record of that
  block id. Tracking is conservative: a loaded block whose hash was later
  recomputed elsewhere still counts as loaded, which costs a recompute, never
  a wrong row.

Failure policy: a hit the cut misses still fails closed on the worker
(``BlockObjectStoreError``); a recorded block is never counted as having
rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock


class LoadedBlockTracker:
    """Blocks filled by external loads, while they still hold that KV."""

    def __init__(self) -> None:
        # block id -> the block's cache hash when the load landed
        self._hashes: dict[int, BlockHashWithGroupId] = {}
        # Async loads in flight: request id -> first loaded token.
        self._pending: dict[str, int] = {}

    def load_started(self, request_id: str, first_loaded_token: int) -> None:
        """An async load was scheduled; its blocks are cached when it lands."""
        self._pending[request_id] = first_loaded_token

    def take_pending(self, request_id: str) -> int | None:
        """The first loaded token of a request's async load, once."""
        return self._pending.pop(request_id, None)

    def forget_request(self, request_id: str) -> None:
        """A request finished or was aborted before its load landed."""
        self._pending.pop(request_id, None)

    def pending_request_ids(self) -> set[str]:
        return set(self._pending)

    def record(
        self,
        blocks: Sequence[Sequence[KVCacheBlock]],
        block_sizes: Sequence[int],
        start_token: int,
        end_token: int,
    ) -> None:
        """Record the cached blocks of each group that cover loaded tokens."""
        for group_blocks, block_size in zip(blocks, block_sizes, strict=True):
            first = start_token // block_size
            last = min(end_token // block_size, len(group_blocks))
            for block in group_blocks[first:last]:
                if block.is_null or block.block_hash is None:
                    continue
                self._hashes[block.block_id] = block.block_hash

    def is_loaded(self, block: KVCacheBlock) -> bool:
        """Whether the block still holds KV recorded as loaded."""
        loaded_hash = self._hashes.get(block.block_id)
        return loaded_hash is not None and loaded_hash == block.block_hash

    def num_records(self) -> int:
        """Recorded block ids, stale ones included (at most one per block)."""
        return len(self._hashes)
