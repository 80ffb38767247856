"""The decode emit floor through a real Scheduler with a NixlConnector kv_consumer.

Drives the remote-prefill lifecycle as a decode instance sees it: the request
waits for its KV, the pull finishes, the first forward is at P - 1, rows are
emitted from there, and the floor is gone when the request finishes. Also the
failed-load recompute path and preemption.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.v1.aux_scheduler_utils import (
    nixl_decode_scheduler,
    runner_output,
    step,
)
from tests.v1.core.pd_scheduler_utils import PROMPT, decode_request
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.usefixtures("scheduler_env")


def pull_finished(
    scheduler: Scheduler, rid: str, fail_first_block: bool = False
) -> None:
    out = scheduler.schedule()  # the request waits for its KV
    assert scheduler.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert (
        not out.aux_output_connector_metadata
        or not out.aux_output_connector_metadata.requests
    )
    invalid = None
    if fail_first_block:
        invalid = {scheduler.kv_cache_manager.get_block_ids(rid)[0][0]}
    scheduler.update_from_output(
        out, runner_output(scheduler, out, recving={rid}, invalid=invalid)
    )


def test_floor_at_the_first_forward_and_cleanup_at_finish(model_dir: Path) -> None:
    scheduler = nixl_decode_scheduler(model_dir)
    scheduler.add_request(decode_request("d"))
    pull_finished(scheduler, "d")
    emit, outputs = step(scheduler)
    assert emit == {"d": PROMPT - 1}
    assert scheduler.aux_output_connector._decode_emit_floors == {"d": PROMPT - 1}
    [first] = outputs
    assert first.routed_experts_start == PROMPT - 1 and len(first.routed_experts) == 1
    # A Python int: the engine's msgspec encoder refuses numpy integers.
    assert type(first.routed_experts_start) is int
    # Later chunks continue the first, so they carry no start (the output
    # processor continues them from the previous end).
    chunks = [(first.routed_experts_start, len(first.routed_experts))]
    while scheduler.requests.get("d") is not None:
        emit, outputs = step(scheduler)
        chunks += [(o.routed_experts_start, len(o.routed_experts)) for o in outputs]
    assert chunks == [(PROMPT - 1, 1), (None, 1), (None, 1)]
    assert scheduler.aux_output_connector._decode_emit_floors == {}


def test_failed_load_with_recompute_lowers_the_floor(model_dir: Path) -> None:
    scheduler = nixl_decode_scheduler(model_dir, policy="recompute")
    scheduler.add_request(decode_request("d"))
    request = scheduler.requests["d"]
    pull_finished(scheduler, "d", fail_first_block=True)
    assert request.num_computed_tokens == 0
    emit, outputs = step(scheduler)
    assert emit == {"d": 0}  # decode recomputes, and returns, the whole prompt
    assert (
        outputs[0].routed_experts_start == 0
        and len(outputs[0].routed_experts) == PROMPT
    )


def test_floor_survives_preemption_and_abort_cleans_up(model_dir: Path) -> None:
    scheduler = nixl_decode_scheduler(model_dir)
    scheduler.add_request(decode_request("d", max_tokens=10))
    pull_finished(scheduler, "d")
    step(scheduler)
    request = scheduler.requests["d"]
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())
    assert scheduler.aux_output_connector._decode_emit_floors == {"d": PROMPT - 1}
    emit, outputs = step(scheduler)
    # Resumed with one output: stock num_tokens - 1 dominates the floor.
    assert emit == {"d": request.num_tokens - 2}
    # The resumed chunk continues at P (nothing re-emitted), so it carries no
    # start; the scheduler's end is past it.
    assert outputs[0].routed_experts_start is None
    assert len(outputs[0].routed_experts) == 1
    assert request.routed_experts_end == PROMPT + 1
    scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert scheduler.aux_output_connector._decode_emit_floors == {}


def test_no_floors_leak_after_many_requests(model_dir: Path) -> None:
    scheduler = nixl_decode_scheduler(model_dir)
    for i in range(40):
        scheduler.add_request(decode_request(f"d{i}", max_tokens=2))
        if i % 4 == 3:
            scheduler.finish_requests(
                f"d{i}", RequestStatus.FINISHED_ABORTED
            )  # before any step
    for _ in range(200):
        if not scheduler.requests:
            break
        out = scheduler.schedule()
        waiting = {
            r.request_id
            for r in scheduler.waiting
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        waiting |= {
            rid
            for rid, r in scheduler.requests.items()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        scheduler.update_from_output(
            out, runner_output(scheduler, out, recving=waiting)
        )
    assert not scheduler.requests
    assert scheduler.aux_output_connector._decode_emit_floors == {}
