"""vLLM 0.34.0 retains routed-experts rows for cached blocks and caps external hits
at them; the series bounds offload lookups by max(rowless blocks, retained rows),
keeps blocks loaded without rows out of the retained set, and leaves P/D decode
requests uncapped (patch `bound-offload-loads-to-positions-without-routed`, vLLM
0.34.0's shape). vLLM 0.31.0 has no such cap and cuts local hits instead; its
series lists test_aux_output_local_hit_cut.py in place of this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.v1.aux_scheduler_utils import make_request, offload_scheduler
from tests.v1.core.loaded_block_utils import (
    BS,
    PD_DECODE,
    PREFIX,
    evict_gpu_cache,
    load_and_finish,
    offload,
    scheduler_after_first_turn,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.usefixtures("scheduler_env")


def test_pd_decode_requests_keep_their_local_hits(model_dir: Path) -> None:
    scheduler = scheduler_after_first_turn(model_dir)
    decode = make_request(
        "d", PREFIX + [7, 7], block_size=BS, kv_transfer_params=dict(PD_DECODE)
    )
    assert scheduler.aux_output_connector.max_cache_hit(decode) is None
    blocks, num_local, _, _ = scheduler._get_local_prefix_cache_hit(decode, None)
    assert num_local == 64
    plain = make_request("p", PREFIX + [7, 7], block_size=BS)  # control: cut to 0
    assert scheduler.aux_output_connector.max_cache_hit(plain) == 0


def _first_turn_computed_then_evicted(model_dir: Path) -> Scheduler:
    scheduler = offload_scheduler(model_dir)
    first = make_request(
        "a", PREFIX + list(range(300, 320)), block_size=BS, prompt_start=0, max_tokens=2
    )
    assert (
        load_and_finish(scheduler, first) == 0
    )  # computed here: its rows are retained
    offload(scheduler, first)
    evict_gpu_cache(scheduler)
    return scheduler


def test_retained_rows_still_let_an_offload_load_pass_the_prompt_start(
    model_dir: Path,
) -> None:
    scheduler = _first_turn_computed_then_evicted(model_dir)
    later = make_request(
        "b", PREFIX + [7, 7], block_size=BS, prompt_start=0, max_tokens=1
    )
    scheduler.add_request(later)
    scheduler.schedule()
    # Rows are needed from 0, yet the 64-token prefix loads: its rows are retained.
    assert later.aux_output_max_hit == 64
    assert later.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert later.num_computed_tokens == 64


def test_without_retained_rows_the_same_load_is_refused(model_dir: Path) -> None:
    """Negative control: a prefix-cache reset drops the retained rows."""
    scheduler = _first_turn_computed_then_evicted(model_dir)
    scheduler.aux_output_connector.reset()
    later = make_request(
        "b", PREFIX + [7, 7], block_size=BS, prompt_start=0, max_tokens=1
    )
    scheduler.add_request(later)
    out = scheduler.schedule()
    assert later.aux_output_max_hit == 0
    assert out.num_scheduled_tokens["b"] == 66


def test_blocks_loaded_without_rows_are_not_retained(model_dir: Path) -> None:
    scheduler = scheduler_after_first_turn(model_dir)  # loaded [0, 64), computed 64 on
    aux = scheduler.aux_output_connector
    first_blocks = list(
        aux._kv_blocks(
            make_request(
                "a", PREFIX + list(range(300, 320)), block_size=BS
            ).block_hashes
        )
    )
    assert len(first_blocks) == 5
    # The stock rule retains every GPU-cached block at finish; all five are cached ...
    assert all(aux._gpu_cached(keys[-1]) for _, keys in first_blocks)
    # ... but only block 4 (tokens 64-79) was computed here and has rows.
    assert [block in aux._kv_cached for block, _ in first_blocks] == [False] * 4 + [
        True
    ]


def test_pd_decode_pulls_bypass_the_retained_rows_cap(model_dir: Path) -> None:
    scheduler = offload_scheduler(model_dir)
    aux = scheduler.aux_output_connector
    decode = make_request(
        "d", PREFIX + [7, 7], block_size=BS, kv_transfer_params=dict(PD_DECODE)
    )
    plain = make_request("p", PREFIX + [7, 7], block_size=BS)
    assert aux.cap_external_hit(decode, 0, 64) == 64  # the prompt KV from prefill
    assert aux.cap_external_hit(plain, 0, 64) == 0  # control: no rows here, refused
