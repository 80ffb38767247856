# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Lease generations: decode never completes a request from KV that the
producer released on lease expiry and may have reused.

Contract:
- The producer's scheduler keeps a generation number per KV block (0 until
  bumped) and hands the generations of a request's blocks out with its
  ``kv_transfer_params`` (``remote_block_generations``, parallel to
  ``remote_block_ids``).
- When a send lease expires, the worker that reaped it reports the request
  in ``NixlWorkerMetadata.expired_send_req_ids``. When the scheduler then
  frees the request's blocks (``finished_sending``), it bumps their
  generations. A normal finish bumps nothing: a block shared by another
  leased request through prefix caching stays valid for that request.
- The bumps travel in the next step's connector metadata, the first step that
  can hand a freed block out again. Every worker writes them into its own
  NIXL-registered host array in ``handle_preemptions``, which runs before that
  step zeroes, copies into, or computes any block.
- Decode posts one READ of the words of the blocks it pulled, per remote rank,
  after that rank's KV READ completed, and sends the notification that lets
  the producer free the blocks only after the words were compared. A word
  that still holds the hand-off's generation after the KV READ ended proves
  the blocks were not released before then, so the KV read is the hand-off's.

Failure policy: a word that changed fails the request's load
(``failed_recving``, then ``kv_load_failure_policy``: recompute or fail), and so
do generations that are present but malformed (``checked_generations``).
Reads that cannot be checked complete as before: from a peer that does not
advertise the array, with parameters missing generations, region-mapped reads
and reads between different block sizes (not checked yet). Each is counted
(``vllm:nixl_num_lease_unchecked_reads``) and each cause is logged once per
remote engine (``skip_check``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.utils import BlockIds
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

PARAMS_KEY = "remote_block_generations"
WORD_DTYPE = np.uint64
WORD_NBYTES = np.dtype(WORD_DTYPE).itemsize


@dataclass
class NixlWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: send leases this step's reaper released."""

    expired_send_req_ids: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, NixlWorkerMetadata)
        return NixlWorkerMetadata(
            self.expired_send_req_ids | other.expired_send_req_ids
        )


class LeaseGenerations:
    """Scheduler side: the generation of every KV block of this instance."""

    def __init__(self) -> None:
        self._generation: dict[int, int] = {}  # block id -> generation, 0 if absent
        self._leased_blocks: dict[str, list[int]] = {}
        self._expired: set[str] = set()
        self._updates: dict[int, int] = {}

    def lease(self, req_id: str, block_ids: BlockIds) -> list[list[int]]:
        """Remember a sent request's blocks; return their generations."""
        self._leased_blocks[req_id] = [b for group in block_ids for b in group]
        return [[self._generation.get(b, 0) for b in group] for group in block_ids]

    def update(
        self,
        worker_meta: KVConnectorWorkerMetadata | None,
        finished_sending: Iterable[str] | None,
    ) -> None:
        """Bump the blocks of every lease that expired and is now freed.

        The reaping worker reports the expiry no later than the aggregated
        ``finished_sending`` of the request, so the flag is always known here.
        """
        if isinstance(worker_meta, NixlWorkerMetadata):
            self._expired |= worker_meta.expired_send_req_ids
        for req_id in finished_sending or ():
            blocks = self._leased_blocks.pop(req_id, ())
            if req_id not in self._expired:
                continue
            self._expired.discard(req_id)
            for block_id in blocks:
                generation = self._generation.get(block_id, 0) + 1
                self._generation[block_id] = generation
                self._updates[block_id] = generation
            logger.warning(
                "KV blocks %s of request %s were released on lease expiry; "
                "a decode instance that reads them now fails its load.",
                blocks,
                req_id,
            )

    def take_updates(self) -> dict[int, int]:
        """The bumps for the next step's metadata (each sent once)."""
        updates, self._updates = self._updates, {}
        return updates


@dataclass
class GenerationRead:
    """Decode side: the words one READ from one remote rank must find."""

    engine_id: str
    remote_rank: int
    local_block_ids: list[int]  # landing slots
    remote_block_ids: list[int]
    expected: list[int]
    handle: int | None = None


def logical_block_ids(kernel_block_ids: BlockIds, per_logical: int) -> list[int]:
    """The logical blocks behind kernel block ids, in order, each once."""
    ids: dict[int, None] = {}
    for group in kernel_block_ids:
        for kernel_id in group:
            ids[kernel_id // per_logical] = None
    return list(ids)


def expected_generations(
    kv_transfer_params: dict[str, Any],
) -> dict[int, int] | None:
    """The hand-off's generation per remote block, or None when it has none.

    Raises ValueError, naming the parameter, when the generations do not
    line up with ``remote_block_ids`` or are not non-negative integers.
    """
    generations = kv_transfer_params.get(PARAMS_KEY)
    if generations is None:
        return None
    block_ids = _block_id_groups(kv_transfer_params)
    if (
        not isinstance(generations, list)
        or [len(g) if isinstance(g, list) else None for g in generations]
        != [len(g) for g in block_ids]
        or not all(_is_count(gen) for group in generations for gen in group)
        or not all(_is_count(block) for group in block_ids for block in group)
    ):
        raise ValueError(
            f"kv_transfer_params.{PARAMS_KEY} must be one list of non-negative "
            "integers per group of remote_block_ids (integers too), of the same "
            f"lengths ({[len(g) for g in block_ids]}); got {generations!r}. "
            "Forward the producer's kv_transfer_params unchanged."
        )
    return {
        block: gen
        for group_ids, group_gens in zip(block_ids, generations)
        for block, gen in zip(group_ids, group_gens)
    }


# A generation no word holds (the words are unsigned): what every block of a
# hand-off whose generations are malformed expects, so that its read fails.
UNMATCHABLE_GENERATION = -1


def checked_generations(
    request_id: str, kv_transfer_params: dict[str, Any]
) -> dict[int, int] | None:
    """What decode checks a hand-off's read against (``expected_generations``).

    Fails closed: generations that are present but malformed make every block
    expect ``UNMATCHABLE_GENERATION``, so the read fails its check and the
    request's load fails (``kv_load_failure_policy``), instead of a read that is
    not checked at all. Only a hand-off without generations (a producer that
    sends none) is read unchecked.
    """
    try:
        return expected_generations(kv_transfer_params)
    except ValueError as e:
        logger.warning(
            "Request %s: %s Its KV read will fail its lease check.", request_id, e
        )
        return {
            block: UNMATCHABLE_GENERATION
            for group in _block_id_groups(kv_transfer_params)
            for block in group
            if _is_count(block)
        }


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _block_id_groups(kv_transfer_params: dict[str, Any]) -> list[list[Any]]:
    """``remote_block_ids`` as one list per KV cache group."""
    block_ids = kv_transfer_params.get("remote_block_ids") or []
    if not isinstance(block_ids, (list, tuple)):
        return []
    if not all(isinstance(group, (list, tuple)) for group in block_ids):
        return [block_ids]  # one group, given as a flat list
    return [list(group) for group in block_ids]


class NixlBlockGenerations:
    """Worker side: this rank's generation words and the checks of reads."""

    def __init__(
        self,
        nixl_wrapper: Any,
        backends: list[str],
        num_blocks: int,
        strided_descs: bool = False,
    ):
        self._nixl = nixl_wrapper
        self._backends = backends
        # The transfer descriptor form the connector gives NIXL: one
        # (addr, len, dev) row per word, or one strided
        # (addr, len, dev, stride, count) row for all of them.
        self._strided_descs = strided_descs
        self.num_blocks = num_blocks
        self.words = np.zeros(num_blocks, dtype=WORD_DTYPE)
        self._reg_descs = [self._register(self.words)]
        # Landing words per remote rank, one slot per local block.
        self._landing: dict[int, tuple[np.ndarray, int]] = {}
        # (engine id, remote rank) -> prepped dlist of that rank's words.
        self._remote_handles: dict[tuple[str, int], int] = {}
        # (engine id, cause) already logged by skip_check.
        self._unchecked: set[tuple[str, str]] = set()
        self._reads: dict[str, list[GenerationRead]] = {}
        self.expired_send_req_ids: set[str] = set()

    def _register(self, words: np.ndarray) -> Any:
        descs = self._nixl.get_reg_descs(
            [(words.ctypes.data, words.nbytes, 0, "")], "DRAM"
        )
        self._nixl.register_memory(descs, backends=self._backends)
        return descs

    def _word_dlist(self, agent_name: str, base_address: int, num: int) -> int:
        """A prepped list of ``num`` word descriptors; descriptor i is word i."""
        if self._strided_descs:
            strided = np.array(
                [[base_address, WORD_NBYTES, 0, WORD_NBYTES, num]], dtype=np.uint64
            )
            return self._nixl.prep_xfer_dlist(agent_name, strided, mem_type="DRAM")
        descs = self._nixl.get_xfer_descs(
            [(base_address + i * WORD_NBYTES, WORD_NBYTES, 0) for i in range(num)],
            "DRAM",
        )
        return self._nixl.prep_xfer_dlist(agent_name, descs)

    def agent_metadata_fields(self) -> dict[str, int]:
        return {
            "block_generations_base_addr": self.words.ctypes.data,
            "block_generations_num_blocks": self.num_blocks,
        }

    # Producer side.
    def apply(self, updates: dict[int, int]) -> None:
        """Write the scheduler's bumps (before this step writes any block)."""
        if updates:
            ids = np.fromiter(updates.keys(), dtype=np.int64, count=len(updates))
            self.words[ids] = np.fromiter(
                updates.values(), dtype=WORD_DTYPE, count=len(updates)
            )

    def take_worker_meta(self) -> NixlWorkerMetadata | None:
        if not self.expired_send_req_ids:
            return None
        meta = NixlWorkerMetadata(self.expired_send_req_ids)
        self.expired_send_req_ids = set()
        return meta

    # Consumer side.
    def add_remote(
        self, engine_id: str, remote_rank: int, agent_name: str, base: int, num: int
    ) -> None:
        if not num or (engine_id, remote_rank) in self._remote_handles:
            return
        if remote_rank not in self._landing:
            landing = np.zeros(self.num_blocks, dtype=WORD_DTYPE)
            self._reg_descs.append(self._register(landing))
            handle = self._word_dlist(
                "NIXL_INIT_AGENT", landing.ctypes.data, len(landing)
            )
            self._landing[remote_rank] = (landing, handle)
        self._remote_handles[(engine_id, remote_rank)] = self._word_dlist(
            agent_name, base, num
        )

    def record_read(
        self,
        req_id: str,
        engine_id: str,
        remote_rank: int,
        local_block_ids: list[int],
        remote_block_ids: list[int],
        expected: dict[int, int] | None,
    ) -> bool:
        """Register the check of one KV READ; False when it is not checked."""
        if expected is None:
            return self.skip_check(engine_id, "it sends no block generations")
        if (engine_id, remote_rank) not in self._remote_handles:
            return self.skip_check(engine_id, "it advertises no block generation words")
        missing = [b for b in remote_block_ids if b not in expected]
        if missing or len(local_block_ids) != len(remote_block_ids):
            return self.skip_check(
                engine_id,
                "its parameters miss the generations of some blocks (first "
                f"seen: request {req_id}, {len(remote_block_ids)} remote / "
                f"{len(local_block_ids)} local blocks, missing {missing[:8]})",
            )
        self._reads.setdefault(req_id, []).append(
            GenerationRead(
                engine_id,
                remote_rank,
                local_block_ids,
                remote_block_ids,
                [expected[b] for b in remote_block_ids],
            )
        )
        return True

    def skip_check(self, engine_id: str, cause: str) -> bool:
        """A read from ``engine_id`` that is not checked; log each cause once
        per engine (the caller counts every read). Returns False."""
        key = (engine_id, cause.split(" (first seen", 1)[0])
        if key not in self._unchecked:
            self._unchecked.add(key)
            logger.warning(
                "KV reads from engine %s are not checked against lease expiry: "
                "%s. Counted in vllm:nixl_num_lease_unchecked_reads; logged "
                "once per cause.",
                engine_id,
                cause,
            )
        return False

    def post_reads(self, req_id: str, handles: list[int]) -> None:
        """Post the word READs of a request whose KV READs are done, adding
        their handles to ``handles`` as they start (none without a check)."""
        for read in self._reads.get(req_id, ()):
            landing, local_handle = self._landing[read.remote_rank]
            landing[read.local_block_ids] = np.iinfo(WORD_DTYPE).max
            read.handle = self._nixl.make_prepped_xfer(
                "READ",
                local_handle,
                read.local_block_ids,
                self._remote_handles[(read.engine_id, read.remote_rank)],
                read.remote_block_ids,
            )
            handles.append(read.handle)
            self._nixl.transfer(read.handle)

    def has_posted(self, req_id: str) -> bool:
        reads = self._reads.get(req_id)
        return bool(reads) and reads[0].handle is not None

    def finish(self, req_id: str) -> str | None:
        """Forget the request's check; describe the first changed word."""
        for read in self._reads.pop(req_id, ()):
            if read.handle is None:
                continue
            landed = self._landing[read.remote_rank][0][read.local_block_ids]
            for block, want, got in zip(read.remote_block_ids, read.expected, landed):
                if int(got) != want:
                    return (
                        f"block {block} of engine {read.engine_id} rank "
                        f"{read.remote_rank} is at generation {int(got)}, the "
                        f"hand-off's was {want}"
                    )
        return None

    def forget(self, req_id: str) -> None:
        self._reads.pop(req_id, None)

    def remove_remote(self, engine_id: str) -> None:
        for key in [k for k in self._remote_handles if k[0] == engine_id]:
            self._nixl.release_dlist_handle(self._remote_handles.pop(key))
        self._unchecked = {key for key in self._unchecked if key[0] != engine_id}

    def shutdown(self) -> None:
        for key in list(self._remote_handles):
            self._nixl.release_dlist_handle(self._remote_handles.pop(key))
        for _, handle in self._landing.values():
            self._nixl.release_dlist_handle(handle)
        self._landing.clear()
        for descs in self._reg_descs:
            self._nixl.deregister_memory(descs)
        self._reg_descs = []

    def unregister(self) -> None:
        """Sleep: release every handle and registration. The words stay, so
        the generations stay monotonic; landing words are made again by the
        next handshake (``add_remote``)."""
        self.shutdown()

    def restore(self) -> None:
        """Wake-up: register the same words again, at the same address."""
        if not self._reg_descs:
            self._reg_descs = [self._register(self.words)]
