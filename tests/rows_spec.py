"""Routed-experts rows as the spec defines them, for tests whose expected values
must not come from the code under test.

- ``spec_chains``: the token chain of each block (rows_transfer.py's docstring:
  blake2b-64 over the previous block's digest, seeded by a constant, and the block's
  token ids as int64), written out here with hashlib.
- ``rows_of_block``: tiny rows whose every value names its block and position.
- ``RowsByHash``: the auxiliary-output store as the output rank reads it (rows by
  block hash), recording every read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

CHAIN_SEED = b"vllm-routed-experts-rows-v1"


def spec_chains(tokens: Sequence[int], block_size: int) -> list[int]:
    """One chain per block of ``tokens`` (the last one may be partial)."""
    previous = CHAIN_SEED
    chains = []
    for start in range(0, len(tokens), block_size):
        block = np.asarray(tokens[start : start + block_size], np.int64).tobytes()
        digest = hashlib.blake2b(previous + block, digest_size=8).digest()
        chains.append(int.from_bytes(digest, "little"))
        previous = digest
    return chains


def rows_of_block(
    index: int, block_size: int = 4, num_layers: int = 2, top_k: int = 2
) -> np.ndarray:
    """Rows of block ``index``: (position, layer, k) holds 10 * index + position."""
    rows = np.zeros((block_size, num_layers, top_k), np.uint8)
    for position in range(block_size):
        rows[position] = 10 * index + position
    return rows


class RowsByHash:
    """The aux-output store as the output rank sees it: rows by block hash."""

    def __init__(self, rows_by_hash: dict[bytes, np.ndarray]) -> None:
        self.rows_by_hash = rows_by_hash
        # Every entry asked for, and the number of reads.
        self.calls: list[tuple[bytes, ...]] = []
        self.reads = 0
        # Step outputs committed: grows with every publish.
        self.committed = 0

    def publish(self, rows_by_hash: dict[bytes, np.ndarray]) -> None:
        """A step's output committed, with these blocks' rows."""
        self.rows_by_hash.update(rows_by_hash)
        self.committed += 1

    def outputs_committed(self) -> int:
        return self.committed

    def blocks_rows(
        self, block_hashes: Sequence[Sequence[bytes]]
    ) -> list[np.ndarray | None]:
        self.reads += 1
        results: list[np.ndarray | None] = []
        for hashes in block_hashes:
            self.calls.append(tuple(bytes(h) for h in hashes))
            parts = [self.rows_by_hash.get(bytes(h)) for h in hashes]
            results.append(
                None if any(p is None for p in parts) else np.concatenate(parts)
            )
        return results
