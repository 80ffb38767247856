"""Connector-loaded blocks through a real Scheduler with the native OffloadingConnector
(patches `bound-offload-loads-to-positions-without-routed` and
`cut-local-prefix-hits-at-kv-blocks-filled-by`): the load limit, then the cut of
later local prefix hits. How vLLM 0.34.0's retained-rows cap bounds the same
loads: test_aux_output_retained_rows_cap.py; the local hits of P/D decode
requests: test_aux_output_local_hit_cut.py (0.31.0) and the cap file (0.34.0).

The offload store is the real CPU offloading manager, filled directly with the
request's block keys (as if a previous turn had been offloaded); the worker side
is simulated by reporting the load finished. bs = 16, 12 KV blocks, as in the
behaviour spec's example.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.v1.aux_scheduler_utils import (
    make_request,
    offload_scheduler,
    runner_output,
    step,
)
from tests.v1.core.loaded_block_utils import (
    BS,
    PD_DECODE,
    PREFIX,
    evict_gpu_cache,
    load_and_finish,
    loaded_now,
    offload,
    scheduler_after_first_turn,
)
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.usefixtures("scheduler_env")


@pytest.mark.parametrize(
    ("prompt_start", "num_computed", "params", "loadable"),
    [
        (0, 0, None, 0),  # rows needed from 0: nothing may be loaded
        (64, 0, None, 64),  # the whole blocks before s
        (70, 0, None, 64),
        (84, 0, None, 80),  # s = P: every full block (the stock bound is P - 1)
        (64, 64, None, 0),  # the local hit already reaches the floor
        (72, 32, None, 32),
        (0, 0, PD_DECODE, 80),  # P/D decode: exempt
    ],
)
def test_native_offload_loads_stop_at_the_prompt_start_floor(
    model_dir: Path,
    prompt_start: int,
    num_computed: int,
    params: dict | None,
    loadable: int,
) -> None:
    scheduler = offload_scheduler(model_dir, num_blocks=100)
    request = make_request(
        "r",
        PREFIX + list(range(300, 320)),
        block_size=BS,
        prompt_start=prompt_start,
        kv_transfer_params=params,
    )
    scheduler.add_request(request)
    offload(scheduler, request)
    hits, load_async = scheduler.connector.get_num_new_matched_tokens(
        request, num_computed
    )
    assert hits == loadable
    assert load_async is (loadable > 0)


def test_without_routed_experts_the_whole_offloaded_prefix_loads(
    model_dir: Path,
) -> None:
    """Negative control for the table: the same request unclamped loads 80 tokens."""
    scheduler = offload_scheduler(model_dir, aux=False, num_blocks=100)
    request = make_request("r", PREFIX + list(range(300, 320)), block_size=BS)
    scheduler.add_request(request)
    offload(scheduler, request)
    assert scheduler.connector.get_num_new_matched_tokens(request, 0) == (80, True)


def test_loaded_blocks_are_cut_from_later_hits_until_reallocated(
    model_dir: Path,
) -> None:
    scheduler = offload_scheduler(model_dir)
    first = make_request(
        "a",
        PREFIX + list(range(300, 320)),
        block_size=BS,
        prompt_start=64,
        max_tokens=2,
    )
    offload(scheduler, first)
    assert (
        load_and_finish(scheduler, first) == 64
    )  # the clamp allows the 64-token prefix
    assert loaded_now(scheduler) == 4
    assert scheduler.aux_output_connector.num_loaded_block_records() == 4

    # Same prefix, rows needed from 0: the 64-token local hit is all loaded blocks.
    cut = make_request(
        "b", PREFIX + [7, 7], block_size=BS, prompt_start=0, max_tokens=1
    )
    scheduler.add_request(cut)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["b"] == 66  # nothing reused: rows are recomputed
    scheduler.update_from_output(out, runner_output(scheduler, out))
    step(scheduler)
    assert "b" not in scheduler.requests

    # Rows needed from 64 only: the loaded blocks may serve as a hit.
    kept = make_request(
        "c", PREFIX + [7, 8], block_size=BS, prompt_start=64, max_tokens=1
    )
    scheduler.add_request(kept)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["c"] == 2
    scheduler.update_from_output(out, runner_output(scheduler, out))
    step(scheduler)

    evict_gpu_cache(scheduler)  # every loaded block is reallocated
    assert loaded_now(scheduler) == 0
    # Records are keyed by block id: never more than the pool has blocks.
    assert scheduler.aux_output_connector.num_loaded_block_records() <= len(
        scheduler.kv_cache_manager.block_pool.blocks
    )


def test_a_hit_is_cut_at_the_first_loaded_block_holding_a_needed_row(
    model_dir: Path,
) -> None:
    scheduler = scheduler_after_first_turn(model_dir)
    # Rows needed from 40: blocks 0-1 may be reused, block 2 (tokens 32-47) is loaded.
    later = make_request(
        "b", PREFIX + [5, 5, 5], block_size=BS, prompt_start=40, max_tokens=1
    )
    scheduler.add_request(later)
    out = scheduler.schedule()
    assert later.num_computed_tokens == 67 and out.num_scheduled_tokens["b"] == 67 - 32


def test_async_load_aborted_before_it_lands_leaves_no_record(model_dir: Path) -> None:
    scheduler = offload_scheduler(model_dir, num_blocks=100)
    tracker = scheduler.aux_output_connector._loaded_blocks
    request = make_request(
        "a", PREFIX + list(range(300, 320)), block_size=BS, prompt_start=64
    )
    offload(scheduler, request)
    scheduler.add_request(request)
    scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert tracker._pending == {"a": 0}
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert tracker._pending == {} and loaded_now(scheduler) == 0
