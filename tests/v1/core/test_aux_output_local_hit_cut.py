"""vLLM 0.31.0 cuts local prefix hits at blocks a connector loaded without rows
(patch `cut-local-prefix-hits-at-kv-blocks-filled-by`), except for P/D decode
requests, whose prompt KV comes from prefill. vLLM 0.34.0 bounds local hits with
its retained-rows cap instead (`max_cache_hit`); its series lists
test_aux_output_retained_rows_cap.py in place of this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.v1.aux_scheduler_utils import make_request
from tests.v1.core.loaded_block_utils import (
    BS,
    PD_DECODE,
    PREFIX,
    scheduler_after_first_turn,
)

pytestmark = pytest.mark.usefixtures("scheduler_env")


def test_pd_decode_requests_keep_their_hits(model_dir: Path) -> None:
    scheduler = scheduler_after_first_turn(model_dir)
    decode = make_request(
        "d", PREFIX + [7, 7], block_size=BS, kv_transfer_params=dict(PD_DECODE)
    )
    blocks, num_local, _, _ = scheduler._get_local_prefix_cache_hit(decode)
    assert num_local == 64
    assert scheduler._cut_local_hit_at_loaded_blocks(decode, blocks, num_local)[1] == 64
