"""Connector-loaded blocks through a real Scheduler with the native OffloadingConnector
(patches `bound-offload-loads-to-positions-without-routed` and
`cut-local-prefix-hits-at-kv-blocks-filled-by`): the load limit, then the cut of
later local prefix hits.

The offload store is the real CPU offloading manager, filled directly with the
request's block keys (as if a previous turn had been offloaded); the worker side
is simulated by reporting the load finished. bs = 16, 12 KV blocks, as in the
behaviour spec's example.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from aux_scheduler_utils import make_request, offload_scheduler, runner_output, step

from tests.fork_base import UPSTREAM_CAPS_EXTERNAL_HITS, only_with_upstream_cap
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    _create_req_context,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.request import Request, RequestStatus

pytestmark = pytest.mark.usefixtures("scheduler_env")

BS = 16
PREFIX = [(11 * i) % 400 + 4 for i in range(64)]
PD_DECODE = {
    "do_remote_prefill": False,
    "do_remote_decode": False,
    "remote_engine_id": "p0",
}


def _req_context(scheduler: Scheduler, request: Request) -> Any:
    """The offload manager's request context; vLLM 0.34.0 builds it with the
    connector's scheduler side, earlier bases from the request alone."""
    if len(inspect.signature(_create_req_context).parameters) == 2:
        return _create_req_context(request, scheduler.connector.connector_scheduler)
    return _create_req_context(request)


def offload(scheduler: Scheduler, request: Request) -> None:
    """Put every full block of the request into the CPU offload store."""
    manager = scheduler.connector.connector_scheduler.manager
    keys = [make_offload_key(h, 0) for h in request.block_hashes]
    context = _req_context(scheduler, request)
    assert manager.prepare_store(keys, context) is not None
    manager.complete_store(keys, context)


def load_and_finish(scheduler: Scheduler, request: Request) -> int:
    """Admit a request whose prefix is offloaded, land its load, run it to the end;
    returns the tokens it loaded."""
    scheduler.add_request(request)
    out = scheduler.schedule()
    loaded = 0
    if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        loaded = request.num_computed_tokens
        scheduler.update_from_output(
            out, runner_output(scheduler, out, recving={request.request_id})
        )
    else:
        scheduler.update_from_output(out, runner_output(scheduler, out))
    while request.request_id in scheduler.requests:
        step(scheduler)
    return loaded


def scheduler_after_first_turn(model_dir: Path) -> Scheduler:
    """A first turn with rows from 64 loaded its offloaded 64-token prefix and
    finished."""
    scheduler = offload_scheduler(model_dir, num_blocks=100)
    first = make_request(
        "a",
        PREFIX + list(range(300, 320)),
        block_size=BS,
        prompt_start=64,
        max_tokens=2,
    )
    offload(scheduler, first)
    assert load_and_finish(scheduler, first) == 64
    return scheduler


def evict_gpu_cache(scheduler: Scheduler) -> None:
    """176 fresh tokens take 11 of the 12 blocks: every cached block is reallocated."""
    fresh = make_request("fresh", list(range(1000, 1176)), block_size=BS, max_tokens=1)
    scheduler.add_request(fresh)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["fresh"] == 176
    scheduler.update_from_output(out, runner_output(scheduler, out))
    while "fresh" in scheduler.requests:
        step(scheduler)


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


def loaded_now(scheduler: Any) -> int:
    """Blocks of the pool that still hold KV recorded as loaded."""
    tracker = scheduler.aux_output_connector._loaded_blocks
    return sum(
        tracker.is_loaded(block)
        for block in scheduler.kv_cache_manager.block_pool.blocks
    )


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


def test_pd_decode_requests_keep_their_hits(model_dir: Path) -> None:
    scheduler = scheduler_after_first_turn(model_dir)
    decode = make_request(
        "d", PREFIX + [7, 7], block_size=BS, kv_transfer_params=dict(PD_DECODE)
    )
    if not UPSTREAM_CAPS_EXTERNAL_HITS:  # 0.31: the scheduler cuts the local hit
        blocks, num_local, _, _ = scheduler._get_local_prefix_cache_hit(decode)
        assert num_local == 64
        assert (
            scheduler._cut_local_hit_at_loaded_blocks(decode, blocks, num_local)[1]
            == 64
        )
    else:  # 0.33: the bound on local hits is max_cache_hit, unbounded for P/D decode
        assert scheduler.aux_output_connector.max_cache_hit(decode) is None
        blocks, num_local, _, _ = scheduler._get_local_prefix_cache_hit(decode, None)
        assert num_local == 64
        plain = make_request("p", PREFIX + [7, 7], block_size=BS)  # control: cut to 0
        assert scheduler.aux_output_connector.max_cache_hit(plain) == 0


# vLLM 0.33 retains rows for cached blocks and caps external hits at them; the 0.33
# series bounds offload lookups by max(rowless blocks, retained rows) and keeps
# loaded blocks out of the retained set. Counterparts on 0.31: the tests above.


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


@only_with_upstream_cap
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


@only_with_upstream_cap
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


@only_with_upstream_cap
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


@only_with_upstream_cap
def test_pd_decode_pulls_bypass_the_retained_rows_cap(model_dir: Path) -> None:
    scheduler = offload_scheduler(model_dir)
    aux = scheduler.aux_output_connector
    decode = make_request(
        "d", PREFIX + [7, 7], block_size=BS, kv_transfer_params=dict(PD_DECODE)
    )
    plain = make_request("p", PREFIX + [7, 7], block_size=BS)
    assert aux.cap_external_hit(decode, 0, 64) == 64  # the prompt KV from prefill
    assert aux.cap_external_hit(plain, 0, 64) == 0  # control: no rows here, refused
