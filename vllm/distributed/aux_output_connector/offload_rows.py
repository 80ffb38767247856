# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routed-expert rows that travel with offloaded KV chunks (RFC #56402).

Enabled by ``KVTransferConfig.enable_routed_experts_transfer`` on an
``OffloadingConnector`` whose tier is the native CPU tier, with or without
secondary tiers (``TieringOffloadingSpec``).

Contract:
- The output rank (TP rank 0) keeps one rows slot per CPU chunk, in the
  ``RowsMirror`` slot format: the chunk's rows and a tag naming its tokens (a
  chain over every earlier token), the positions it covers, the rows format
  and a checksum. Where the tier is a shared region the slot sits in the
  chunk's row after every worker's KV (``OffloadingConfig.block_trailer_nbytes``),
  so secondary tiers, which copy whole rows, carry it to their files and back,
  across restarts too; their namespace names the rows format
  (``FileMapper``). Otherwise it sits in a host array beside the tier.
- Store: once a store job's KV copy has finished, the output rank reads each
  stored chunk's rows from this instance's auxiliary-output store by block
  hash and writes them into the chunk's slot. Under asynchronous scheduling a
  step's rows are published when its output is fetched, which may come after
  the next step's stores finished: the job's completion then waits for them
  through up to ``ROWS_WAIT_POLLS`` more polls (the engine keeps stepping
  while a store job is pending, and fetches a step's output before it
  schedules the step after next). A chunk whose rows are still not there (its
  KV was loaded without rows, the rows were evicted) gets an empty tag. The
  job's completion tells the scheduler which chunks have rows; it forgets that
  when the chunk is evicted or stored again.
- Lookup: a chunk that holds a position whose rows the request emits is a hit
  only if it has rows, so the hit ends at the first such chunk without them.
  Chunks wholly before that position load without rows, as before (see
  offload.py). With secondary tiers, a chunk no store of this process
  reported (one a tier brought back) is judged by its slot against the
  request's tokens: the offloading manager reports each promoted chunk with
  the bytes after its KV (take_promoted_trailers), and the lookup judges a
  chunk as it reaches it, so one lookup decides. One not in the CPU tier yet
  is left to the lookup, which brings it in.
- Load: the output rank copies the loaded chunks' slots into the rows-mirror
  slots of the destination KV blocks and checks each tag against the one the
  scheduler derived from the request's own tokens. The scheduler then imports
  the rows before the request's first forward, as for a P/D pull
  (rows_transfer.py), and they become this instance's rows.

Failure policy: a slot whose tag does not match (other tokens, a rows format
change, bytes that fail their checksum, a slot never written) is a load error
of its KV block, handled by ``kv_load_failure_policy``: the block is
recomputed with fresh rows, or the request fails. A row is never emitted from
such a slot, and the chunk stops counting as one with rows.

A slot that fails the scheduler's own check is not a hit: the blocks are
computed afresh.

Supported (refused at startup otherwise, ``offload_rows_layout_problem``): an
offloading spec that keeps rows slots for its chunks
(``OffloadingSpec.routed_experts_rows_slots``: the native CPU tier and its
secondary tiers), one offloaded KV cache group of full attention, one KV block
per chunk, no partial-tail chunks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from vllm.distributed.aux_output_connector.rows_transfer import (
    RowsFormat,
    RowsMirror,
    SlotCheck,
    extend_block_token_chains,
    rows_format,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


@dataclass(frozen=True)
class ChunkRowsSource:
    """Store: where the ``position``-th chunk of a store job finds its rows."""

    position: int
    # The block hashes that key the chunk's rows in the auxiliary-output store.
    block_hashes: tuple[bytes, ...]
    # The token chain of the chunk (rows_transfer.block_token_chains).
    chain: int


@dataclass(frozen=True)
class ChunkRowsCheck:
    """Load: the ``position``-th chunk of a load job lands in ``check.block_id``
    and its slot must pass ``check``."""

    position: int
    check: SlotCheck


# The polls (engine steps) a store job's completion waits for rows its chunks'
# blocks do not have yet, under asynchronous scheduling; then they are stored
# without them.
ROWS_WAIT_POLLS = 3


class BlockRowsReader(Protocol):
    def blocks_rows(
        self, block_hashes: Sequence[Sequence[bytes]]
    ) -> list[np.ndarray | None]:
        """For each entry, the rows of the blocks it names (concatenated), or
        None if any of them is missing."""
        ...

    def outputs_committed(self) -> int:
        """A count that grows whenever step outputs publish rows; read without
        a lock, so a reader that waits for rows asks ``blocks_rows`` (which
        locks against the token output path) again only when it has grown."""
        ...


def offload_rows_trailer(vllm_config: VllmConfig) -> tuple[int, str | None]:
    """The bytes and the format name of the rows slot that follows each block's
    KV in a shared region's chunk row, or (0, None) when rows do not travel."""
    fmt = rows_format(vllm_config)
    if fmt is None:
        return 0, None
    return fmt.slot_nbytes, f"routed_experts_rows {fmt.describe()}"


def offload_rows_layout_problem(
    spec_name: str,
    rows_slots: int | None,
    num_groups: int,
    blocks_per_chunk: int,
    sliding_window: bool,
    partial_tail: bool,
) -> str | None:
    """Why rows cannot travel with this offload layout, or None."""
    if rows_slots is None:
        return (
            f"the offloading spec {spec_name} keeps no rows slots for its chunks "
            "(OffloadingSpec.routed_experts_rows_slots)"
        )
    if num_groups != 1:
        return f"{num_groups} KV cache groups are offloaded, not one"
    if blocks_per_chunk != 1:
        return f"a chunk holds {blocks_per_chunk} KV blocks, not one"
    if sliding_window:
        return "the offloaded group uses sliding-window attention"
    if partial_tail:
        return "partial-tail chunks are offloaded"
    return None


def chunk_trailer_slots(
    chunk_rows: np.ndarray, trailer_offset: int, slot_nbytes: int
) -> np.ndarray:
    """The rows slots inside a shared region's chunk rows: a ``(num_chunks,
    slot_nbytes)`` view of ``chunk_rows`` (``(num_chunks, row_stride)`` bytes)
    starting ``trailer_offset`` bytes into each row. Writes go to the region,
    so every tier that copies whole chunk rows carries the slots too."""
    rows = chunk_rows.view(np.uint8)
    num_chunks, row_stride = rows.shape
    if trailer_offset + slot_nbytes > row_stride:
        raise ValueError(
            f"a rows slot of {slot_nbytes} B at offset {trailer_offset} does not "
            f"fit a chunk row of {row_stride} B"
        )
    return rows[:, trailer_offset : trailer_offset + slot_nbytes]


class OffloadedRowsSlots:
    """Output rank: one rows slot per CPU chunk of the offload tier, in a host
    array of its own, or inside the tier's shared region (``slots``)."""

    def __init__(
        self,
        fmt: RowsFormat,
        num_chunks: int,
        mirror: RowsMirror,
        slots: np.ndarray | None = None,
    ) -> None:
        self.slots = RowsMirror(fmt, num_chunks, slots)
        self._mirror = mirror

    def write_stored(
        self,
        chunk_ids: Sequence[int],
        sources: Sequence[ChunkRowsSource],
        reader: BlockRowsReader | None,
        wait: bool = False,
    ) -> tuple[int, ...] | None:
        """Write the rows of freshly stored chunks into their slots; return the
        positions (in the job) of the chunks whose slots now hold rows. With
        ``wait``, write nothing and return None while some chunk's rows are
        not published yet."""
        if reader is None:
            found: list[np.ndarray | None] = [None] * len(sources)
        else:
            found = reader.blocks_rows([s.block_hashes for s in sources])
        block_size = self.slots.format.block_size
        with_rows = [
            (source, rows)
            for source, rows in zip(sources, found, strict=True)
            if rows is not None and len(rows) == block_size
        ]
        if wait and reader is not None and len(with_rows) < len(sources):
            return None
        self.slots.write_whole_slots(
            [int(chunk_ids[source.position]) for source, _ in with_rows],
            [source.chain for source, _ in with_rows],
            [rows for _, rows in with_rows],
        )
        if len(with_rows) < len(sources):
            positions = {source.position for source, _ in with_rows}
            self.slots.invalidate(
                [
                    int(chunk_ids[s.position])
                    for s in sources
                    if s.position not in positions
                ]
            )
            logger.debug(
                "Offloaded %d of %d chunk(s) without routed-experts rows",
                len(sources) - len(with_rows),
                len(sources),
            )
        return tuple(source.position for source, _ in with_rows)

    def import_loaded(
        self, chunk_ids: Sequence[int], checks: Sequence[ChunkRowsCheck]
    ) -> tuple[tuple[int, ...], set[int]]:
        """Copy loaded chunks' slots into the mirror slots of their KV blocks
        and check them; return the positions and KV block ids that failed."""
        if not checks:
            return (), set()
        self._mirror.copy_slots(
            self.slots,
            [int(chunk_ids[c.position]) for c in checks],
            [c.check.block_id for c in checks],
        )
        failed_positions = []
        failed_blocks = set()
        problems = self._mirror.slot_problems([c.check for c in checks])
        for c, problem in zip(checks, problems, strict=True):
            if problem is None:
                continue
            logger.warning(
                "Offloaded chunk %d loaded into KV block %d has routed-experts "
                "rows that failed their check (%s); the block is reported as a "
                "KV load error (kv_load_failure_policy).",
                int(chunk_ids[c.position]),
                c.check.block_id,
                problem,
            )
            failed_positions.append(c.position)
            failed_blocks.add(c.check.block_id)
        return tuple(failed_positions), failed_blocks


def slot_has_rows(fmt: RowsFormat, slot: bytes, chain: int) -> bool:
    """Whether one rows slot's bytes (a chunk's trailer, as a tier copied it)
    hold the whole block's rows of the tokens whose chain is ``chain``: its tag
    and checksum match."""
    slots = np.frombuffer(slot, np.uint8).reshape(1, -1)
    check = SlotCheck(0, chain, 0, fmt.block_size)
    return RowsMirror(fmt, 1, slots).slot_problems([check])[0] is None


@dataclass
class _RowsWalk:
    """Where a request's last walk over its chunks got to (rows_load_limit)."""

    removals: int  # the index's count of chunks that lost their rows, then
    rows_from: int
    first_chunk: int
    # Chunks [first_chunk, next_chunk) had rows, or held no position whose
    # rows the request emits.
    next_chunk: int


class OffloadedRowsIndex:
    """Scheduler side: which offloaded chunks hold rows, and what the output
    rank needs to write and check them."""

    def __init__(
        self, block_size: int, promoted_format: RowsFormat | None = None
    ) -> None:
        """``promoted_format``: the rows format of the slots of chunks that
        secondary tiers promote into the CPU tier; None when none do."""
        self.block_size = block_size
        self._promoted_format = promoted_format
        # Chunks a secondary tier promoted and no question has passed yet: the
        # bytes of their rows slot, as the offloading manager reported them.
        self._promoted: dict[bytes, bytes] = {}
        # Offload keys of chunks whose slot holds rows (reported by the output
        # rank with the store's completion).
        self._keys_with_rows: set[bytes] = set()
        # Store jobs in flight: the keys in the job's chunk order, and the
        # positions reported with rows so far.
        self._store_keys: dict[int, list[bytes]] = {}
        self._stored_positions: dict[int, set[int]] = {}
        # Load jobs in flight: the keys in the job's chunk order.
        self._load_keys: dict[int, list[bytes]] = {}
        # Token chains of each request's blocks, extended as it grows.
        self._chains: dict[str, list[int]] = {}
        # Each waiting request's last walk, and how many chunks lost their
        # rows so far: a walk resumes where the last one stopped unless one did.
        self._walks: dict[str, _RowsWalk] = {}
        self._removals = 0

    def has_rows(self, key: bytes) -> bool:
        return key in self._keys_with_rows

    def chunk_has_rows(
        self, key: bytes, request_id: str, token_ids: Sequence[int], index: int
    ) -> bool | None:
        """Whether chunk ``key``, block ``index`` of the request, has rows: a
        store of this process reported them, or its slot passed the check when
        a secondary tier promoted it. None: not known here but possibly in a
        secondary tier, which a lookup must reach (then this is asked again)."""
        if key in self._keys_with_rows:
            return True
        if self._promoted_format is None:
            return False
        slot = self._promoted.get(key)
        if slot is None:
            return None
        chain = self.chains(request_id, token_ids, index + 1)[index]
        if not slot_has_rows(self._promoted_format, slot, chain):
            return False
        del self._promoted[key]
        self._keys_with_rows.add(key)
        return True

    def note_promoted(self, key: bytes, slot: bytes) -> None:
        """A secondary tier brought chunk ``key`` into the CPU tier with this
        rows slot; the next question about the chunk judges it."""
        self._lose_rows((key,))
        self._promoted[key] = slot

    def walk_start(self, request_id: str, rows_from: int, first_chunk: int) -> int:
        """Where a walk over the request's chunks from ``first_chunk`` starts:
        past those its last walk found with rows (or needing none), unless a
        chunk lost its rows since, its rows start moved, or this walk starts
        before that one did (a preemption)."""
        walk = self._walks.get(request_id)
        if (
            walk is None
            or walk.removals != self._removals
            or walk.rows_from != rows_from
            or first_chunk < walk.first_chunk
        ):
            return first_chunk
        return max(first_chunk, walk.next_chunk)

    def note_walk(
        self, request_id: str, rows_from: int, first_chunk: int, next_chunk: int
    ) -> None:
        """Chunks [first_chunk, next_chunk) of the request had rows, or held no
        position whose rows it emits."""
        self._walks[request_id] = _RowsWalk(
            self._removals, rows_from, first_chunk, next_chunk
        )

    def _lose_rows(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._promoted.pop(key, None)
            if key in self._keys_with_rows:
                self._keys_with_rows.discard(key)
                self._removals += 1

    def chains(
        self, request_id: str, token_ids: Sequence[int], num_blocks: int
    ) -> list[int]:
        """The token chains of a request's first ``num_blocks`` blocks."""
        chains = self._chains.setdefault(request_id, [])
        extend_block_token_chains(chains, token_ids, self.block_size, num_blocks)
        return chains

    def store_started(
        self,
        job_id: int,
        request_id: str,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        hashes_per_chunk: int,
        keys: Sequence[bytes],
        chunk_indices: Sequence[int],
    ) -> tuple[ChunkRowsSource, ...]:
        """A store job of ``keys`` (chunks ``chunk_indices`` of the request, in
        the job's order, one KV block each) was built: what the output rank
        writes for it."""
        self._store_keys[job_id] = list(keys)
        self._stored_positions[job_id] = set()
        chains = self.chains(request_id, token_ids, max(chunk_indices, default=-1) + 1)
        return tuple(
            ChunkRowsSource(
                position,
                tuple(
                    block_hashes[
                        index * hashes_per_chunk : (index + 1) * hashes_per_chunk
                    ]
                ),
                chains[index],
            )
            for position, index in enumerate(chunk_indices)
        )

    def rows_stored(self, job_id: int, positions: Sequence[int]) -> None:
        """The output rank wrote rows for these chunks of a store job."""
        stored = self._stored_positions.get(job_id)
        if stored is not None:
            stored.update(positions)

    def load_started(self, job_id: int, keys: Sequence[bytes]) -> None:
        self._load_keys[job_id] = list(keys)

    def rows_rejected(self, job_id: int, positions: Sequence[int]) -> None:
        """These chunks of a load job failed the rows check: they no longer
        count as chunks with rows."""
        keys = self._load_keys.get(job_id)
        if keys is not None:  # else a job from before a cache reset
            self.forget([keys[position] for position in positions])

    def job_finished(self, job_id: int) -> None:
        """Every worker finished a job. A store's chunks have rows exactly
        where the output rank wrote them."""
        self._load_keys.pop(job_id, None)
        keys = self._store_keys.pop(job_id, None)
        stored = self._stored_positions.pop(job_id, set())
        for position, key in enumerate(keys or ()):
            if position in stored:
                self._keys_with_rows.add(key)
            else:
                self._lose_rows((key,))

    def forget(self, keys: Sequence[bytes]) -> None:
        """The chunks were evicted, or their rows failed a load check."""
        self._lose_rows(keys)

    def request_finished(self, request_id: str) -> None:
        self._chains.pop(request_id, None)
        self._walks.pop(request_id, None)

    def reset(self) -> None:
        self._keys_with_rows.clear()
        self._promoted.clear()
        self._store_keys.clear()
        self._stored_positions.clear()
        self._load_keys.clear()
        self._chains.clear()
        self._walks.clear()
        self._removals += 1
