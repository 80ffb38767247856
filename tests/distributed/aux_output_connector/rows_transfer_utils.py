"""The rows format and prompt the rows-transfer tests share (test_rows_transfer.py,
test_rows_mirror_ownership.py).

Rows are distinguishable: row p holds the value p in every slot (a `base` shifts
them, e.g. decode's own recomputed rows hold 100 + p).
"""

from __future__ import annotations

import numpy as np

from vllm.distributed.aux_output_connector.rows_transfer import RowsFormat

SHAPE = (3, 2)  # (layers, top_k)
BS = 4
PROMPT = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32]  # 10 tokens: blocks 0, 4, 8 (partial)


def rows(start: int, end: int, base: int = 0) -> np.ndarray:
    return np.broadcast_to(
        np.arange(base + start, base + end, dtype=np.uint8)[:, None, None],
        (end - start, *SHAPE),
    ).copy()


def fmt() -> RowsFormat:
    return RowsFormat(num_layers=3, top_k=2, dtype="uint8", block_size=BS)
