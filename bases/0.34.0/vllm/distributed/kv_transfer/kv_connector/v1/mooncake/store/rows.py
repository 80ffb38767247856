# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routed-expert rows stored beside their KV chunks in the Mooncake store
(RFC #56402).

Enabled by ``KVTransferConfig.enable_routed_experts_transfer`` on a
``MooncakeStoreConnector`` (a MultiConnector child sets it on its own config).

Contract:
- Every stored chunk (one KV block of the single KV cache group) may have one
  rows object beside its KV objects. Its key is the chunk's key with TP, PCP,
  DCP and PP rank 0 and the rows namespace (``rows_namespace``: the rows format)
  appended to the store namespace, so the same chunk hash names it and another
  rows format never reads it. Its value is one ``RowsMirror`` slot: the block's
  rows and a tag naming its tokens (a chain over every earlier token), the
  positions it covers, the rows format and a checksum. Where Mooncake groups
  are on, it joins its chunk's lifecycle group.
- Store (output rank, ``StoreRowsPutter``'s own thread): after a job's KV put,
  the send thread releases the job's KV blocks and hands its chunks to the
  putter, which never blocks it. The chunks whose rows object is missing get
  one, with the rows this instance's auxiliary-output store holds under the
  chunk's block hash, staged in the putter's own registered slots (never a KV
  block). Rows of blocks the job's own step computes are published after that
  step's sampling, so they are waited for, up to ``ROWS_WAIT_SECONDS``, without
  delaying other jobs: the putter asks the auxiliary-output store again only
  when it has committed another step's output. A chunk whose rows are not there
  (e.g. its request was aborted) gets no rows object. The KV put never waits
  for rows, and a rows put that fails never fails the KV save.
- Lookup (rank 0): a chunk that holds a position whose rows the request emits
  counts only when its rows object exists too, checked in the same
  ``batch_is_exist`` as its KV keys; the hit ends at the first chunk without
  one. Chunks wholly before that position load without rows, as before
  (``aux_output_connector/offload.py``).
- Load (output rank, receive thread): after the KV get, the rows objects of
  the loaded chunks whose rows the request emits are read, copied into the
  rows-mirror slots of their destination blocks and checked against the tags
  the scheduler derived from the request's own tokens. The scheduler then
  imports the rows before the request's first forward, as for a P/D pull
  (``aux_output_connector/rows_transfer.py``).

Failure policy: a rows object that is missing at load time, cannot be read, or
whose tag does not match (other tokens, another rows format, bytes that fail
their checksum) is a load error of its KV block, handled by
``kv_load_failure_policy``: the block is recomputed with fresh rows, or the
request fails. A row is never emitted from such an object. An object that
failed its check is removed; until the store lets it go (a reader's lease holds
it), lookups count its chunk as having no rows object (``RejectedRowsKeys``), so
a bad object costs one failed load, never a loop of them.

Supported (refused at startup otherwise, ``store_rows_layout_problem``): one
prefix-cached KV cache group of full attention, chunks of one KV block, no
partial-hash hits.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.distributed.aux_output_connector.disaggregated import (
    emits_from_first_forward,
)
from vllm.distributed.aux_output_connector.offload import rows_needed_from
from vllm.distributed.aux_output_connector.offload_rows import BlockRowsReader
from vllm.distributed.aux_output_connector.rows_transfer import (
    RowsFormat,
    RowsMirror,
    SlotCheck,
    extend_block_token_chains,
    pulled_slot_checks,
    rows_format,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.layout import (
    KeyMetadata,
    PoolKey,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

# How long the output rank's send thread waits for the rows of blocks its job's
# step computed (they are published after that step's sampling).
ROWS_WAIT_SECONDS = 10.0
# Mooncake's code for a key the store does not hold.
OBJECT_NOT_FOUND = -704
# Rejected rows objects remembered until removed; the oldest are forgotten first.
REJECTED_CAPACITY = 65536
# The putter's registered staging slots: the rows objects one put stages at most.
PUT_SLOTS = 256
# Chunks waiting for their rows at most; past it the oldest are given up.
MAX_WAITING_CHUNKS = 65536
# How often a putter with chunks waiting looks at the reader's commit count, and
# how long an idle one waits for work before it looks at its stop flag.
POLL_SECONDS = 0.005
IDLE_SECONDS = 0.1


def rows_namespace(fmt: RowsFormat) -> str:
    """The store-namespace suffix of rows objects: one per rows format."""
    digest = zlib.crc32(fmt.describe().encode())
    return f"/r3rows-v{fmt.version}-{digest:08x}"


def rows_key_prefix(metadata: KeyMetadata, fmt: RowsFormat) -> str:
    """The key prefix of the rows objects of a KV cache group's chunks."""
    rows_metadata = dataclasses.replace(
        metadata,
        store_namespace=metadata.store_namespace + rows_namespace(fmt),
        tp_rank=0,
        pcp_rank=0,
        dcp_rank=0,
        pp_rank=0,
    )
    return PoolKey.build_prefix(rows_metadata)


def rows_key(prefix: str, block_hash: bytes) -> str:
    return PoolKey.build_key_string(prefix, bytes(block_hash).hex())


def store_rows_layout_problem(
    num_groups: int,
    full_attention: bool,
    block_size: int,
    hash_block_size: int,
    partial_hash_hits: bool,
) -> str | None:
    """Why rows cannot be stored beside this Mooncake store layout, or None."""
    if num_groups != 1:
        return f"{num_groups} KV cache groups are stored, not one"
    if not full_attention:
        return "the stored KV cache group is not full attention"
    if block_size != hash_block_size:
        return (
            f"a chunk of {block_size} tokens holds several hash blocks of "
            f"{hash_block_size}, not one"
        )
    if partial_hash_hits:
        return "partial-hash hits (enable_partial_hash_hits) are on"
    return None


def store_rows_from(vllm_config: VllmConfig, request: Request) -> int | None:
    """The first position whose rows a load must bring for ``request``, or None
    when rows do not travel with this connector or the request emits none from
    loaded positions (a P/D decode request that emits from its first forward)."""
    if rows_format(vllm_config) is None:
        return None
    if emits_from_first_forward(request.kv_transfer_params):
        return None
    return rows_needed_from(request)


def first_chunk_needing_rows(rows_from: int | None, block_size: int) -> int | None:
    """The index of the first chunk that holds a position from ``rows_from`` on:
    chunks from there on count as hits only with their rows object."""
    if rows_from is None:
        return None
    return rows_from // block_size


@dataclass(frozen=True)
class StoreRowsJob:
    """Scheduler to output rank, with a store or load request of the connector
    metadata: what the rows objects of its chunks must hold."""

    # Store: the token chain of each of the request's first blocks.
    chains: tuple[int, ...] = ()
    # Store: positions from here on are computed by this step's forward, so
    # their rows are published after it and are waited for.
    computed_from: int = 0
    # Load: each destination block whose rows the request emits, and the hash
    # index of its chunk, with what its slot must hold.
    checks: tuple[tuple[int, SlotCheck], ...] = ()


class StoreRowsPlanner:
    """Scheduler side: what the rows objects of a request's stored and loaded
    chunks must hold."""

    def __init__(self, vllm_config: VllmConfig, block_size: int) -> None:
        self._vllm_config = vllm_config
        self.block_size = block_size
        # Token chains of each request's blocks, extended as it grows.
        self._chains: dict[str, list[int]] = {}

    def _request_chains(self, request: Request, num_blocks: int) -> list[int]:
        chains = self._chains.setdefault(request.request_id, [])
        extend_block_token_chains(
            chains, request.all_token_ids, self.block_size, num_blocks
        )
        return chains[:num_blocks]

    def job(
        self,
        request: Request,
        block_ids: Sequence[int],
        store_len: int | None,
        load: tuple[int, int] | None,
    ) -> StoreRowsJob | None:
        """The rows job of a store of the request's first ``store_len`` tokens
        and of a load of positions ``load`` = [start, end), with the request's
        blocks ``block_ids`` (from block 0 on); None when neither needs rows."""
        chains: tuple[int, ...] = ()
        if store_len is not None:
            num_blocks = min(store_len, request.num_tokens) // self.block_size
            chains = tuple(self._request_chains(request, num_blocks))
        checks: tuple[tuple[int, SlotCheck], ...] = ()
        rows_from = store_rows_from(self._vllm_config, request)
        if load is not None and rows_from is not None and rows_from < load[1]:
            first = load[0] // self.block_size
            last = -(-load[1] // self.block_size)
            found = pulled_slot_checks(
                request.all_token_ids,
                self.block_size,
                first,
                block_ids[first:last],
                rows_from,
                load[1],
            )
            index_of = {block_ids[i]: i for i in range(first, last)}
            checks = tuple((index_of[check.block_id], check) for check in found)
        if not chains and not checks:
            return None
        return StoreRowsJob(chains, request.num_computed_tokens, checks)

    def request_finished(self, request_id: str) -> None:
        self._chains.pop(request_id, None)


@dataclass(frozen=True)
class ChunkRowsPut:
    """One stored chunk whose rows object a store job asks for."""

    req_id: str
    block_hash: bytes
    # The token chain of the chunk's block (its tag).
    chain: int
    # Its rows are published by the job's own step, after the job was queued.
    must_wait: bool
    # time.monotonic() past which rows that are still missing are given up.
    deadline: float


def chunk_rows_puts(
    req_id: str,
    chunk_starts: Sequence[int],
    block_size: int,
    block_hashes: Sequence[bytes],
    job: StoreRowsJob,
    now: float,
    wait_seconds: float = ROWS_WAIT_SECONDS,
) -> list[ChunkRowsPut]:
    """The chunks of a store job (their first token positions) that can get a
    rows object: those the job's token chains cover."""
    puts = []
    for start in chunk_starts:
        index = start // block_size
        if index >= len(job.chains):
            continue
        puts.append(
            ChunkRowsPut(
                req_id,
                bytes(block_hashes[index]),
                job.chains[index],
                (index + 1) * block_size > job.computed_from,
                now + wait_seconds,
            )
        )
    return puts


@dataclass(frozen=True)
class RowsPut:
    """The rows objects a store job puts: keys, and where each value lies."""

    keys: list[str]
    addrs: list[list[int]]
    sizes: list[list[int]]


class RejectedRowsKeys:
    """Rows objects that failed their check and are not removed from the store
    yet: the store refuses to remove an object while a reader holds its lease,
    which the failed get itself has just taken. Until one is removed, lookups
    treat its chunk as having no rows object (a lost hit, never the same failed
    load again), and the next store of the chunk removes it first. Thread-safe
    (receive thread, send thread, lookup server); the oldest are forgotten past
    ``capacity``."""

    def __init__(self, capacity: int = REJECTED_CAPACITY) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self._capacity:
                self._keys.popitem(last=False)

    def discard(self, key: str) -> None:
        with self._lock:
            self._keys.pop(key, None)

    def among(self, keys: Sequence[str]) -> list[str]:
        with self._lock:
            return [key for key in keys if key in self._keys]

    def remove_from(self, store: Any, keys: Sequence[str]) -> None:
        """Try to remove these rejected objects; forget those that are gone."""
        for key in keys:
            try:
                code = store.remove(key)
            except Exception as e:
                logger.debug("Rejected rows object %s not removed yet: %s", key, e)
                continue
            if code in (0, None, OBJECT_NOT_FOUND):
                self.discard(key)
            else:
                logger.debug("Rejected rows object %s not removed yet (%s)", key, code)


class StoreRowsSlots:
    """Output rank: a registered host array with one rows slot per KV block,
    the source of rows puts and the destination of rows gets, and the rows
    mirror that loaded rows are imported from."""

    def __init__(
        self, fmt: RowsFormat, num_blocks: int, mirror: RowsMirror, key_prefix: str
    ) -> None:
        self.format = fmt
        self.staging = RowsMirror(fmt, num_blocks)
        self._mirror = mirror
        self.key_prefix = key_prefix
        self.rejected = RejectedRowsKeys()

    def register(self, store: Any) -> None:
        ret = store.register_buffer(self.staging.base_address, self.staging.nbytes)
        if ret != 0:
            raise RuntimeError(
                "Mooncake register_buffer failed for the routed-experts rows "
                f"slots ({self.staging.nbytes} B): {ret}"
            )

    def key(self, block_hash: bytes) -> str:
        return rows_key(self.key_prefix, block_hash)

    def _slot(self, block_id: int) -> tuple[list[int], list[int]]:
        nbytes = self.format.slot_nbytes
        return [self.staging.base_address + block_id * nbytes], [nbytes]

    def prepare_get(
        self, checks: Sequence[tuple[int, SlotCheck]], block_hashes: Sequence[bytes]
    ) -> RowsPut:
        """What to get for a load's checks, into the slots of their blocks
        (emptied first, so a short read never leaves an older tag behind)."""
        self.staging.invalidate([check.block_id for _, check in checks])
        get = RowsPut([], [], [])
        for index, check in checks:
            addrs, sizes = self._slot(check.block_id)
            get.keys.append(self.key(block_hashes[index]))
            get.addrs.append(addrs)
            get.sizes.append(sizes)
        return get

    def check_loaded(
        self,
        checks: Sequence[tuple[int, SlotCheck]],
        get: RowsPut,
        results: Sequence[int],
    ) -> tuple[list[int], list[str]]:
        """Copy the rows a load got (``results``: the per-key codes of ``get``)
        into the rows mirror and check them; return the KV block ids that
        failed, and the keys of the objects that were read but failed their
        check (to be removed, so the next store of the chunk replaces them)."""
        failed: list[int] = []
        got: list[SlotCheck] = []
        key_of: dict[int, str] = {}
        for (_, check), key, result in zip(checks, get.keys, results, strict=True):
            key_of[check.block_id] = key
            if result < 0:
                logger.warning(
                    "The routed-experts rows object of KV block %d could not be "
                    "read from the Mooncake store (%d); the block is reported as a "
                    "KV load error (kv_load_failure_policy).",
                    check.block_id,
                    result,
                )
                failed.append(check.block_id)
            else:
                got.append(check)
        rejected: list[str] = []
        if not got:
            return failed, rejected
        block_ids = [check.block_id for check in got]
        self._mirror.copy_slots(self.staging, block_ids, block_ids)
        for check, problem in zip(got, self._mirror.slot_problems(got), strict=True):
            if problem is None:
                continue
            logger.warning(
                "The Mooncake store rows object loaded into KV block %d has "
                "routed-experts rows that failed their check (%s); the block is "
                "reported as a KV load error (kv_load_failure_policy) and the "
                "object is removed.",
                check.block_id,
                problem,
            )
            failed.append(check.block_id)
            rejected.append(key_of[check.block_id])
        return failed, rejected


# Puts rows objects: (keys, addresses, sizes) -> a code per key, negative on failure.
RowsObjectsPut = Callable[[list[str], list[list[int]], list[list[int]]], list[int]]


class StoreRowsPutter:
    """Output rank: puts the rows objects of stored chunks from a thread of its
    own, so the KV send thread never waits for rows and never holds a job's KV
    blocks for them.

    ``submit`` never blocks. Rows are read by block hash from ``reader`` (the
    engine's auxiliary-output worker, whose ``blocks_rows`` may be called from
    this thread) into the putter's own registered slots. Chunks whose rows are not
    published yet wait until their deadline; while any wait, the putter reads
    the reader's commit count (no lock) every ``POLL_SECONDS`` and asks for rows
    again only when it has grown, so waiting never takes the auxiliary-output
    lock per poll. A store failure is logged and costs the chunk its rows
    object, never the KV save.
    """

    def __init__(
        self,
        slots: StoreRowsSlots,
        store: Any,
        put: RowsObjectsPut,
        reader: BlockRowsReader,
        capacity: int = PUT_SLOTS,
    ) -> None:
        self.format = slots.format
        self._slots = slots
        self._store = store
        self._put = put
        self._reader = reader
        self.staging = RowsMirror(slots.format, capacity)
        self._submitted: queue.SimpleQueue[list[ChunkRowsPut]] = queue.SimpleQueue()
        self._waiting: list[ChunkRowsPut] = []
        self._seen_commits: int | None = None
        # Chunks stored without a rows object because their rows never came.
        self.given_up = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="MooncakeStoreRowsPutter", daemon=True
        )

    def register(self) -> None:
        ret = self._store.register_buffer(
            self.staging.base_address, self.staging.nbytes
        )
        if ret != 0:
            raise RuntimeError(
                "Mooncake register_buffer failed for the routed-experts rows "
                f"put slots ({self.staging.nbytes} B): {ret}"
            )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def submit(self, chunks: list[ChunkRowsPut]) -> None:
        if chunks:
            self._submitted.put(chunks)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.put_once(POLL_SECONDS if self._waiting else IDLE_SECONDS)
            except Exception:
                logger.exception("The routed-experts rows putter failed a round")

    def _take(self, timeout: float) -> list[ChunkRowsPut]:
        """What was submitted, waiting up to ``timeout`` for the first job."""
        try:
            chunks = list(self._submitted.get(timeout=timeout))
        except queue.Empty:
            return []
        while True:
            try:
                chunks += self._submitted.get_nowait()
            except queue.Empty:
                return chunks

    def _not_stored_yet(self, chunks: list[ChunkRowsPut]) -> list[ChunkRowsPut]:
        """The chunks without a rows object; a rejected one is removed first."""
        keys = [self._slots.key(c.block_hash) for c in chunks]
        try:
            rejected = self._slots.rejected
            rejected.remove_from(self._store, rejected.among(keys))
            exists = self._store.batch_is_exist(keys)
        except Exception as e:
            logger.warning("Routed-experts rows objects not looked up: %s", e)
            return []
        return [c for c, state in zip(chunks, exists, strict=True) if state != 1]

    def put_once(self, timeout: float = 0.0) -> None:
        """One round: take what was submitted (waiting up to ``timeout``), put
        the rows objects whose rows are there, keep waiting for the rest."""
        new = self._take(timeout)
        if new:
            new = self._not_stored_yet(new)
        reader = self._reader
        commits = reader.outputs_committed()
        retry = commits != self._seen_commits
        self._seen_commits = commits
        asking = new + (self._waiting if retry else [])
        still = [] if retry else self._waiting
        if asking:
            found = reader.blocks_rows([[c.block_hash] for c in asking])
            ready = []
            for chunk, rows in zip(asking, found, strict=True):
                if rows is not None and len(rows) == self.format.block_size:
                    ready.append((chunk, rows))
                elif chunk.must_wait:
                    still.append(chunk)
            for first in range(0, len(ready), self.staging.num_blocks):
                self._put_ready(ready[first : first + self.staging.num_blocks])
        self._waiting = self._drop_expired(still)

    def _drop_expired(self, chunks: list[ChunkRowsPut]) -> list[ChunkRowsPut]:
        now = time.monotonic()
        alive = [c for c in chunks if c.deadline > now][-MAX_WAITING_CHUNKS:]
        if len(alive) < len(chunks):
            self.given_up += len(chunks) - len(alive)
            logger.debug(
                "Storing %d chunk(s) without routed-experts rows: their rows were "
                "not published in time (an aborted request never publishes them)",
                len(chunks) - len(alive),
            )
        return alive

    def _put_ready(self, ready: list[tuple[ChunkRowsPut, np.ndarray]]) -> None:
        nbytes = self.format.slot_nbytes
        self.staging.write_whole_slots(
            range(len(ready)), [c.chain for c, _ in ready], [r for _, r in ready]
        )
        keys = [self._slots.key(c.block_hash) for c, _ in ready]
        addrs = [[self.staging.base_address + i * nbytes] for i in range(len(ready))]
        try:
            codes = self._put(keys, addrs, [[nbytes]] * len(ready))
        except Exception as e:
            logger.warning("Failed to store routed-experts rows objects: %s", e)
            return
        failed = [code for code in codes if code < 0]
        if failed:
            logger.warning(
                "Failed to store %d of %d routed-experts rows objects (codes=%s); "
                "those chunks load without rows.",
                len(failed),
                len(keys),
                set(failed),
            )
