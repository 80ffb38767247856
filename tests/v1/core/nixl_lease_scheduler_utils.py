"""A NixlConnector producer's Scheduler and its hand-offs, for the lease-generation
scheduler tests (test_nixl_lease_generations_scheduler.py, tests/v1/metrics)."""

from __future__ import annotations

from pathlib import Path

from tests.v1.aux_scheduler_utils import (
    make_request,
    make_scheduler,
    plain_runner_output,
)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.block_generations import (
    PARAMS_KEY,
    NixlWorkerMetadata,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput

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
