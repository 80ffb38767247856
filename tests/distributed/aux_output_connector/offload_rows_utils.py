"""The rows format, tokens and rows the offloaded-rows tests share
(test_offload_rows.py, test_offload_rows_in_tiers.py): tiny rows whose every value
names its position (tests/rows_spec.py), in blocks of 4."""

from __future__ import annotations

import numpy as np

from tests.rows_spec import rows_of_block as spec_rows_of_block
from vllm.distributed.aux_output_connector.rows_transfer import RowsFormat

BS = 4
FMT = RowsFormat(num_layers=2, top_k=2, dtype="uint8", block_size=BS)
TOKENS = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]  # 2 full blocks and a partial one


def rows_of_block(index: int) -> np.ndarray:
    return spec_rows_of_block(index, BS)
