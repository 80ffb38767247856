"""Lease generations through a real Scheduler with a NixlConnector producer.

A prefill instance's hand-off carries the generations of its blocks
(``remote_block_generations``); when a worker reports the lease expired, the
scheduler frees the blocks and the next step's connector metadata carries the
bumps, so the workers write them before that step can reuse a block. A normal
finish bumps nothing. Values are hand-derived: generations start at 0 and go up
by one per expiry of a lease that held the block.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from aux_scheduler_utils import make_request, make_scheduler, plain_runner_output

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.block_generations import (
    PARAMS_KEY,
    NixlWorkerMetadata,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput

pytestmark = pytest.mark.usefixtures("scheduler_env")

PROMPT = [(5 * i) % 300 + 3 for i in range(40)]  # 3 blocks of 16


def producer(model_dir: Path) -> Scheduler:
    return make_scheduler(
        model_dir,
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer"),
        aux=False,
    )


def hand_off(scheduler: Scheduler, rid: str) -> tuple[list[list[int]], list[list[int]]]:
    """Prefill one hand-off request; return its block ids and generations."""
    request = make_request(
        rid, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    scheduler.add_request(request)
    out = scheduler.schedule()
    engine = scheduler.update_from_output(out, plain_runner_output(out))
    (finished,) = [o for outputs in engine.values() for o in outputs.outputs]
    params = finished.kv_transfer_params
    assert params is not None
    return params["remote_block_ids"], params[PARAMS_KEY]


def finish_sending(scheduler: Scheduler, rid: str, expired: bool) -> dict[int, int]:
    """Report the send finished (or its lease expired); return the generation
    updates the next step's metadata carries to the workers."""
    meta = NixlWorkerMetadata({rid}) if expired else None
    out = scheduler.schedule()
    sent = KVConnectorOutput(finished_sending={rid}, kv_connector_worker_meta=meta)
    scheduler.update_from_output(out, plain_runner_output(out, sent))
    assert rid not in scheduler.requests  # the blocks are free
    return scheduler.schedule().kv_connector_metadata.block_generation_updates


def test_expired_lease_bumps_its_blocks_for_the_workers(model_dir: Path) -> None:
    scheduler = producer(model_dir)
    blocks, generations = hand_off(scheduler, "a")
    assert len(blocks) == 1 and len(blocks[0]) == 3
    assert generations == [[0, 0, 0]]
    updates = finish_sending(scheduler, "a", expired=True)
    assert updates == {b: 1 for b in blocks[0]}
    # Sent once: the step after carries nothing.
    assert scheduler.schedule().kv_connector_metadata.block_generation_updates == {}
    # The same prompt again hits the freed (cached) blocks: its hand-off carries
    # the generation the workers now hold.
    again, generations = hand_off(scheduler, "b")
    assert again[0][:2] == blocks[0][:2]
    assert generations[0][:2] == [1, 1]
    assert finish_sending(scheduler, "b", expired=True) == {
        b: (2 if b in blocks[0] else 1) for b in again[0]
    }


def test_normal_finish_bumps_nothing(model_dir: Path) -> None:
    """Negative control: the same lifecycle without the expiry report."""
    scheduler = producer(model_dir)
    blocks, _ = hand_off(scheduler, "a")
    assert finish_sending(scheduler, "a", expired=False) == {}
    _, generations = hand_off(scheduler, "b")
    assert generations == [[0, 0, 0]]
