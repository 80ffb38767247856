# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scheduler-side record of KV blocks filled by external loads.

Contract:
- A block whose KV came from a KV-connector load (KV offload, a NIXL pull)
  has no auxiliary rows: rows are only produced by a local forward. Once the
  load lands the block is cached, and later requests reach it as a plain
  local prefix hit that no connector load limit sees.
- ``AuxOutputSchedulerConnector`` records every loaded block (async loads
  when they land) and cuts a later request's local hit at the first recorded
  block that holds a position whose rows it must emit. The cut tokens are
  recomputed locally, which publishes their rows.
- Records are keyed by block id and hold the block's cache hash at the load,
  so there are never more records than KV-cache blocks. A record counts while
  the block still has that hash; once the block is reallocated (its hash
  changes) the record is stale and is replaced by the next record of that
  block id. Tracking is conservative: a loaded block whose hash was later
  recomputed elsewhere still counts as loaded, which costs a recompute, never
  a wrong row.

Failure policy: a hit the cut misses still fails closed on the worker
(``BlockObjectStoreError``); the cut never hands out a block without rows
where rows are needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock
    from vllm.v1.request import Request


def rows_needed_from(request: Request) -> int:
    """The first position whose rows a request will still emit.

    ``routed_experts_prompt_start`` before any output; after a preemption the
    resumed request emits from its last token (``num_tokens - 1``) on.
    """
    prompt_start = (
        request.sampling_params.routed_experts_prompt_start
        if request.sampling_params is not None
        else 0
    )
    if request.num_output_tokens == 0:
        return prompt_start
    return max(prompt_start, request.num_tokens - 1)


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

    def hit_tokens_to_keep(
        self,
        hit_blocks: Sequence[Sequence[KVCacheBlock]],
        block_sizes: Sequence[int],
        num_hit_tokens: int,
        rows_needed_from: int,
        alignment: int,
    ) -> int:
        """How much of a local prefix hit may be used.

        The hit is cut at the first loaded block that holds a position at or
        after ``rows_needed_from``, rounded down to ``alignment`` (the
        scheduler block size, which every group's block size divides).
        """
        if not self._hashes:
            return num_hit_tokens
        keep = num_hit_tokens
        for group_blocks, block_size in zip(hit_blocks, block_sizes, strict=True):
            for index, block in enumerate(group_blocks):
                if index * block_size >= keep:
                    break
                if (index + 1) * block_size <= rows_needed_from:
                    continue
                if self.is_loaded(block):
                    keep = index * block_size
                    break
        if keep == num_hit_tokens:
            return keep
        return keep - keep % alignment

    def num_records(self) -> int:
        """Recorded block ids, stale ones included (at most one per block)."""
        return len(self._hashes)
