"""A real Scheduler with the native OffloadingConnector whose offload store is filled
directly (as if a previous turn had been offloaded) and whose loads are landed by
reporting them finished: bs = 16, 12 KV blocks, as in the behaviour spec's example
(tests/v1/core/test_aux_output_loaded_block_cut.py and the files it names)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from tests.v1.aux_scheduler_utils import (
    make_request,
    offload_scheduler,
    runner_output,
    step,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    _create_req_context,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.request import Request, RequestStatus

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


def loaded_now(scheduler: Any) -> int:
    """Blocks of the pool that still hold KV recorded as loaded."""
    tracker = scheduler.aux_output_connector._loaded_blocks
    return sum(
        tracker.is_loaded(block)
        for block in scheduler.kv_cache_manager.block_pool.blocks
    )
