# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routed-expert rows that travel with their KV blocks over a P/D transfer.

Enabled by ``KVTransferConfig.enable_routed_experts_transfer`` on both roles
(RFC #55584).

Contract:
- The output rank of every instance keeps a rows mirror: one slot per KV block
  id (the single KV cache group), holding that block's rows and a tag.
- A prefill instance writes the rows of a request it hands off
  (``do_remote_decode``) into the slots of that request's blocks in the step
  that completes its prompt, before the scheduler returns the request's
  ``kv_transfer_params``. The KV connector's lease keeps the blocks, and so
  the slots, unchanged until the decode instance has read them.
- The decode instance reads the slots of the blocks it pulls in the same
  transfer as their KV, checks every slot's tag against the one it derives
  from its own prompt tokens, and imports the rows into its capture before the
  request's first forward. From then on the rows are decode's own: published
  under its block keys and returned with the rest.

Failure policy: a slot whose tag does not match (other tokens, other
positions, rows not covering what decode needs, bytes that do not match their
checksum, a slot never written) is a load error of its KV block, handled by
``kv_load_failure_policy`` like any failed KV read: recomputed with fresh
rows, or the request fails. A row is never emitted from such a slot. Decode
clears the tags of a request's landing slots before it posts any READ for it,
so a slot that no READ filled fails its check. The checks are explicit
(``ValueError``), never ``assert``: they hold under ``python -O``.

Ownership: the auxiliary-output worker of an engine's output rank creates
the mirror (``new_rows_mirror``) and owns it. The model runner hands that
worker to the KV connector before the connector registers its KV caches
(``KVConnectorBase_V1.set_aux_output_worker``); the connector takes the mirror
from it (``handed_rows_mirror``). So a connector moves the mirror of its own
engine: no registry, nothing shared between two engines in one process. A
connector that needs the mirror and was not handed one fails at startup.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.aux_output_connector.worker import (
        AuxOutputWorkerConnector,
    )

ROWS_FORMAT_VERSION = 1
# Tag words per slot: magic|version, lo<<32|hi, token chain, rows crc32.
_TAG_WORDS = 4
_TAG_NBYTES = _TAG_WORDS * 8
_MAGIC = 0x52335257  # "R3RW"
_CHAIN_SEED = b"vllm-routed-experts-rows-v1"


@dataclass(frozen=True)
class RowsFormat:
    """What both roles must agree on to exchange rows."""

    num_layers: int
    top_k: int
    dtype: str
    block_size: int
    version: int = ROWS_FORMAT_VERSION

    def describe(self) -> str:
        return (
            f"v{self.version} layers={self.num_layers} top_k={self.top_k} "
            f"dtype={self.dtype} block_size={self.block_size}"
        )

    @property
    def rows_nbytes(self) -> int:
        itemsize = np.dtype(self.dtype).itemsize
        return self.block_size * self.num_layers * self.top_k * itemsize

    @property
    def slot_nbytes(self) -> int:
        return self.rows_nbytes + _TAG_NBYTES


def rows_transfer_enabled(vllm_config: VllmConfig) -> bool:
    kv_transfer_config = vllm_config.kv_transfer_config
    return bool(
        kv_transfer_config is not None
        and kv_transfer_config.enable_routed_experts_transfer
        and vllm_config.aux_output_config.enabled
    )


def rows_format(vllm_config: VllmConfig) -> RowsFormat | None:
    """The rows format of this instance, or None when rows do not travel."""
    if not rows_transfer_enabled(vllm_config):
        return None
    model_config = vllm_config.model_config
    return RowsFormat(
        num_layers=model_config.get_total_num_hidden_layers(),
        top_k=model_config.get_num_experts_per_tok(),
        # The capture dtype (RoutedExpertsCapturer.output_dtype_name).
        dtype="uint8" if model_config.get_num_experts() <= 256 else "uint16",
        block_size=vllm_config.cache_config.block_size,
    )


def check_peer_rows_format(local: str, remote: str, remote_engine_id: str) -> None:
    """Refuse a peer whose rows format differs (one-sided switch included)."""
    if local == remote:
        return
    raise RuntimeError(
        "routed-experts rows transfer mismatch with remote engine "
        f"{remote_engine_id}: this instance {local or 'off'}, the remote "
        f"{remote or 'off'}. Set kv_transfer_config.enable_routed_experts_transfer "
        "the same on the prefill and the decode instances, for the same model "
        "and block size."
    )


def block_token_chains(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One 64-bit value per block of ``token_ids`` (the last may be partial),
    chained over every earlier block: equal only for the same tokens at the same
    positions. Seeded by a constant, so both instances derive the same values
    whatever their prefix-cache hash seeds."""
    chains: list[int] = []
    extend_block_token_chains(
        chains, token_ids, block_size, -(-len(token_ids) // block_size)
    )
    return chains


def extend_block_token_chains(
    chains: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int
) -> None:
    """Append to ``chains`` (the values of the first blocks of ``token_ids``,
    as ``block_token_chains`` derives them) the values of the blocks up to
    ``num_blocks``, so a growing sequence hashes each block once."""
    previous = chains[-1].to_bytes(8, "little") if chains else _CHAIN_SEED
    for index in range(len(chains), num_blocks):
        start = index * block_size
        block = np.asarray(token_ids[start : start + block_size], dtype=np.int64)
        digest = hashlib.blake2b(previous + block.tobytes(), digest_size=8).digest()
        chains.append(int.from_bytes(digest, "little"))
        previous = digest


@dataclass(frozen=True)
class RowsExport:
    """Prefill: write rows of positions [start, end) into the slots of
    ``block_ids`` (the blocks from block ``start // block_size`` on)."""

    start: int
    end: int
    block_ids: tuple[int, ...]
    chains: tuple[int, ...]


@dataclass(frozen=True)
class RowsImport:
    """Decode: rows of positions [start, end) arrived in the slots of
    ``block_ids`` (the blocks from block ``start // block_size`` on).
    ``checks``: what each slot must hold (``RowsMirror.read`` verifies them
    again before it copies a row; ``import_checked_rows`` derives them)."""

    start: int
    end: int
    block_ids: tuple[int, ...]
    checks: tuple[SlotCheck, ...] = ()


def import_checked_rows(
    token_ids: Sequence[int],
    block_size: int,
    start: int,
    end: int,
    block_ids: tuple[int, ...],
) -> RowsImport:
    """The import of the rows of [start, end) that a load brought into the
    slots of ``block_ids``, with the check of every slot from the request's
    tokens: the worker reads no slot whose tag does not match."""
    checks = pulled_slot_checks(
        token_ids, block_size, start // block_size, block_ids, start, end
    )
    return RowsImport(start, end, block_ids, checks)


@dataclass(frozen=True)
class SlotCheck:
    """Decode: what the slot of a pulled block must hold."""

    block_id: int
    chain: int
    # Positions within the block whose rows decode needs; lo == hi needs none.
    need_lo: int
    need_hi: int


def pulled_slot_checks(
    token_ids: Sequence[int],
    block_size: int,
    first_block_index: int,
    block_ids: Sequence[int],
    rows_start: int,
    pull_end: int,
) -> tuple[SlotCheck, ...]:
    """The checks for ``block_ids``, pulled for the blocks from
    ``first_block_index`` on, of a request that needs rows from ``rows_start``
    and pulls KV up to position ``pull_end``."""
    chains = block_token_chains(token_ids, block_size)
    checks = []
    for offset, block_id in enumerate(block_ids):
        index = first_block_index + offset
        if index >= len(chains):
            break
        block_start = index * block_size
        lo = min(max(rows_start, block_start), block_start + block_size)
        hi = max(min(pull_end, block_start + block_size), lo)
        if lo < hi:
            checks.append(
                SlotCheck(block_id, chains[index], lo - block_start, hi - block_start)
            )
    return tuple(checks)


def _resident_zeros(shape: tuple[int, int]) -> np.ndarray:
    """A zeroed uint8 array whose pages are mapped now. ``np.zeros`` maps
    them on first write, so every 4 KiB of a fresh mirror would fault inside
    the engine step that first clears or fills it; this pays them at startup."""
    slots = np.empty(shape, np.uint8)
    slots.fill(0)
    return slots


class RowsMirror:
    """One slot per KV block: the block's rows and their tag, in one host array
    that a KV connector registers for transfer."""

    def __init__(
        self, fmt: RowsFormat, num_blocks: int, slots: np.ndarray | None = None
    ) -> None:
        """``slots``: where the slots live, a ``(num_blocks, slot_nbytes)`` uint8
        array whose rows may be strided (a shared region's chunk rows); by
        default a new zeroed host array."""
        self.format = fmt
        self.num_blocks = num_blocks
        if slots is None:
            slots = _resident_zeros((num_blocks, fmt.slot_nbytes))
        if slots.shape != (num_blocks, fmt.slot_nbytes) or slots.dtype != np.uint8:
            raise ValueError(
                f"rows slots must be a ({num_blocks}, {fmt.slot_nbytes}) uint8 "
                f"array, got {slots.shape} {slots.dtype}"
            )
        if slots.strides[1] != 1:
            raise ValueError(f"rows slots must be contiguous per slot: {slots.strides}")
        self.slots: np.ndarray = slots
        self._shape = (fmt.block_size, fmt.num_layers, fmt.top_k)
        self._dtype = np.dtype(fmt.dtype)

    @property
    def base_address(self) -> int:
        return int(self.slots.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.slots.nbytes)

    def _rows(self, block_id: int) -> np.ndarray:
        rows = self.slots[block_id, : self.format.rows_nbytes]
        return rows.view(self._dtype).reshape(self._shape)

    def _tag(self, block_id: int) -> np.ndarray:
        return self.slots[block_id, self.format.rows_nbytes :].view(np.uint64)

    def write(self, export: RowsExport, rows: np.ndarray) -> None:
        """Write the rows of [export.start, export.end) and their tags."""
        block_size = self.format.block_size
        if len(rows) != export.end - export.start:
            raise ValueError(
                f"{len(rows)} rows do not cover the export "
                f"[{export.start}, {export.end})"
            )
        first = export.start // block_size
        for offset, block_id in enumerate(export.block_ids):
            block_start = (first + offset) * block_size
            lo = max(export.start, block_start) - block_start
            hi = min(export.end, block_start + block_size) - block_start
            if lo >= hi:
                continue
            first_row = block_start - export.start
            self.write_slot(
                block_id,
                export.chains[first + offset],
                rows[first_row + lo : first_row + hi],
                lo,
            )

    def write_slot(self, slot: int, chain: int, rows: np.ndarray, lo: int = 0) -> None:
        """Write the rows of positions [lo, lo + len(rows)) of one block, whose
        token chain is ``chain``, into ``slot`` and tag them."""
        hi = lo + len(rows)
        if not 0 <= lo < hi <= self.format.block_size:
            raise ValueError(
                f"rows of positions [{lo}, {hi}) do not fit a block of "
                f"{self.format.block_size}"
            )
        self._rows(slot)[lo:hi] = rows
        self._tag(slot)[:] = (
            (_MAGIC << 32) | self.format.version,
            (lo << 32) | hi,
            chain,
            zlib.crc32(self._rows(slot)[lo:hi]),
        )

    def write_whole_slots(
        self, slots: Sequence[int], chains: Sequence[int], rows: Sequence[np.ndarray]
    ) -> None:
        """``write_slot`` for whole blocks, many at once: ``rows[i]`` holds every
        position of the block whose token chain is ``chains[i]``."""
        if not slots:
            return
        nbytes = self.format.rows_nbytes
        for slot, block_rows in zip(slots, rows, strict=True):
            if block_rows.shape != self._shape:
                raise ValueError(f"rows {block_rows.shape}, a block is {self._shape}")
            self.slots[slot, :nbytes] = block_rows.reshape(-1).view(np.uint8)
        tags = np.empty((len(slots), _TAG_WORDS), np.uint64)
        tags[:, 0] = (_MAGIC << 32) | self.format.version
        tags[:, 1] = self.format.block_size  # positions [0, block_size)
        tags[:, 2] = np.array(chains, np.uint64)
        tags[:, 3] = [zlib.crc32(self.slots[slot, :nbytes]) for slot in slots]
        self.slots[list(slots), nbytes:] = tags.view(np.uint8)

    def slot_problems(self, checks: Sequence[SlotCheck]) -> list[str | None]:
        """``slot_problem`` of each check; the tags are compared at once."""
        if not checks:
            return []
        nbytes = self.format.rows_nbytes
        tags = self.slots[[c.block_id for c in checks], nbytes:].view(np.uint64)
        lo, hi = tags[:, 1] >> np.uint64(32), tags[:, 1] & np.uint64(0xFFFFFFFF)
        tagged = (
            (tags[:, 0] == (_MAGIC << 32) | self.format.version)
            & (tags[:, 2] == np.array([c.chain for c in checks], np.uint64))
            & (lo <= np.array([c.need_lo for c in checks], np.uint64))
            & (np.array([c.need_hi for c in checks], np.uint64) <= hi)
            & (hi <= self.format.block_size)
        )
        per_position = nbytes // self.format.block_size
        problems: list[str | None] = []
        for index, check in enumerate(checks):
            if tagged[index]:
                start, end = (
                    int(lo[index]) * per_position,
                    int(hi[index]) * per_position,
                )
                rows = self.slots[check.block_id, start:end]
                if zlib.crc32(rows) == int(tags[index, 3]):
                    problems.append(None)
                    continue
            problems.append(self.slot_problem(check))
        return problems

    def copy_slots(
        self, source: RowsMirror, source_slots: Sequence[int], slots: Sequence[int]
    ) -> None:
        """Copy whole slots (rows and tags) of ``source`` into ``slots``."""
        if source.format != self.format:
            raise ValueError(
                f"rows slots of {source.format.describe()} into "
                f"{self.format.describe()}"
            )
        self.slots[list(slots)] = source.slots[list(source_slots)]

    def invalidate(self, block_ids: Sequence[int]) -> None:
        if len(block_ids):
            self.slots[list(block_ids), self.format.rows_nbytes :] = 0

    def slot_problem(self, check: SlotCheck) -> str | None:
        """Why the slot does not hold what decode needs, or None."""
        magic_version, span, chain, crc = (int(w) for w in self._tag(check.block_id))
        if magic_version != (_MAGIC << 32) | self.format.version:
            return "no rows (tag not written by this format)"
        if chain != check.chain:
            return "rows of other tokens"
        lo, hi = span >> 32, span & 0xFFFFFFFF
        if not (lo <= check.need_lo and check.need_hi <= hi <= self.format.block_size):
            return f"rows of [{lo}, {hi}), need [{check.need_lo}, {check.need_hi})"
        if zlib.crc32(self._rows(check.block_id)[lo:hi]) != crc:
            return "rows do not match their checksum"
        return None

    def read(self, rows_import: RowsImport) -> np.ndarray:
        """The rows of [rows_import.start, rows_import.end), slot by slot,
        after each slot passed its check (``rows_import.checks``)."""
        problems = self.slot_problems(rows_import.checks)
        for check, problem in zip(rows_import.checks, problems, strict=True):
            if problem is not None:
                raise ValueError(
                    f"routed-experts rows import [{rows_import.start}, "
                    f"{rows_import.end}): the slot of block {check.block_id} "
                    f"failed its check: {problem}"
                )
        block_size = self.format.block_size
        first = rows_import.start // block_size
        parts = []
        for offset, block_id in enumerate(rows_import.block_ids):
            block_start = (first + offset) * block_size
            lo = max(rows_import.start, block_start) - block_start
            hi = min(rows_import.end, block_start + block_size) - block_start
            if lo < hi:
                parts.append(self._rows(block_id)[lo:hi])
        rows = np.concatenate(parts) if parts else np.empty((0, *self._shape[1:]))
        if len(rows) != rows_import.end - rows_import.start:
            raise ValueError(
                f"routed-experts rows import [{rows_import.start}, "
                f"{rows_import.end}) is not covered by its "
                f"{len(rows_import.block_ids)} blocks"
            )
        return rows.astype(self._dtype, copy=True)


def new_rows_mirror(vllm_config: VllmConfig, num_blocks: int) -> RowsMirror | None:
    """A rows mirror of ``num_blocks`` slots for an engine's output rank, or
    None when rows do not travel. Its auxiliary-output worker creates and owns
    it; see the module docstring."""
    fmt = rows_format(vllm_config)
    if fmt is None:
        return None
    return RowsMirror(fmt, num_blocks)


def handed_rows_mirror(
    aux_output_worker: AuxOutputWorkerConnector | None,
    num_blocks: int,
    connector: str,
) -> RowsMirror:
    """The rows mirror ``connector`` moves on the output rank: the one its
    engine's auxiliary-output worker owns, handed over before the connector
    registers its KV caches. Raises (at startup) when none was handed, or when
    it has another number of slots than the connector's KV blocks."""
    mirror = None if aux_output_worker is None else aux_output_worker.rows_mirror
    if mirror is None:
        raise RuntimeError(
            "kv_transfer_config.enable_routed_experts_transfer is on, but "
            f"{connector} was not handed its engine's routed-experts rows "
            "(KVConnectorBase_V1.set_aux_output_worker) before it registered "
            "its KV caches; this model runner does not hand them. Run Model "
            "Runner V2, or remove enable_routed_experts_transfer."
        )
    if mirror.num_blocks != num_blocks:
        raise RuntimeError(
            f"{connector} has {num_blocks} KV blocks but was handed a "
            f"routed-experts rows mirror of {mirror.num_blocks} slots; the "
            "auxiliary-output worker and the KV connector must be built from "
            "the same KV cache config."
        )
    return mirror
