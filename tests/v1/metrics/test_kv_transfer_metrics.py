"""What the scheduler reports for /metrics about KV load failures and about finished
requests whose blocks a KV transfer holds (patch
`count-kv-load-failures-and-requests-held-for-kv`).

Driven through a real Scheduler with NixlConnector; each step's SchedulerStats is
read from the engine outputs, as the API server's stat loggers get it. Expected
values are derived by hand: a failed pull is one request, labelled by what
kv_load_failure_policy did with it; a prefill hand-off holds its blocks from its
finish until its send completes. Then vLLM's PrometheusStatLogger, built from the
scheduler's config, records them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import prometheus_client
import pytest

from tests.v1.aux_scheduler_utils import (
    make_request,
    make_scheduler,
    nixl_decode_scheduler,
    plain_runner_output,
)
from tests.v1.core.kv_load_failure_utils import remote_request
from vllm.config import KVTransferConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

pytestmark = pytest.mark.usefixtures("scheduler_env")

PROMPT = [(5 * i) % 300 + 3 for i in range(40)]  # 3 blocks of 16


def update(scheduler: Scheduler, out: Any, output: ModelRunnerOutput) -> SchedulerStats:
    engine = scheduler.update_from_output(out, output)
    return next(iter(engine.values())).scheduler_stats


@pytest.mark.parametrize(
    ("policy", "outcome"), [("fail", "failed"), ("recompute", "recomputed")]
)
def test_a_failed_pull_is_counted_by_outcome(
    model_dir: Path, policy: str, outcome: str
) -> None:
    scheduler = nixl_decode_scheduler(model_dir, policy, aux=False)
    scheduler.add_request(remote_request("d"))
    out = scheduler.schedule()
    failed = KVConnectorOutput(finished_recving={"d"}, failed_recving={"d"})
    stats = update(scheduler, out, plain_runner_output(out, failed))
    assert stats.kv_load_failed_reqs == {outcome: 1}
    # The counts are taken: the next stats start from nothing.
    assert scheduler.make_stats().kv_load_failed_reqs == {}
    # A pull that succeeds counts nothing.
    scheduler.add_request(remote_request("e"))
    out = scheduler.schedule()
    done = KVConnectorOutput(finished_recving={"e"})
    assert (
        update(scheduler, out, plain_runner_output(out, done)).kv_load_failed_reqs == {}
    )


def hand_off(scheduler: Scheduler, rid: str) -> None:
    """Prefill one request for decode; it finishes after its first token."""
    request = make_request(
        rid, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, plain_runner_output(out))


def finish_sending(scheduler: Scheduler, rid: str) -> None:
    out = scheduler.schedule()
    sent = KVConnectorOutput(finished_sending={rid})
    scheduler.update_from_output(out, plain_runner_output(out, sent))


def test_a_hand_off_is_held_until_its_send_finishes(model_dir: Path) -> None:
    scheduler = make_scheduler(
        model_dir,
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer"),
        aux=False,
    )
    assert scheduler.make_stats().kv_transfer_held_reqs == 0
    hand_off(scheduler, "a")
    hand_off(scheduler, "b")
    assert {"a", "b"} <= set(scheduler.requests)  # finished, blocks kept
    assert scheduler.make_stats().kv_transfer_held_reqs == 2
    finish_sending(scheduler, "a")
    assert "a" not in scheduler.requests
    assert scheduler.make_stats().kv_transfer_held_reqs == 1
    finish_sending(scheduler, "b")
    assert scheduler.make_stats().kv_transfer_held_reqs == 0
    # A request that is not handed off holds nothing once it finishes.
    scheduler.add_request(make_request("c", PROMPT, max_tokens=1))
    out = scheduler.schedule()
    scheduler.update_from_output(out, plain_runner_output(out))
    assert "c" not in scheduler.requests
    assert scheduler.make_stats().kv_transfer_held_reqs == 0


def sample(name: str, scheduler: Scheduler, **labels: str) -> float | None:
    served = scheduler.vllm_config.model_config.served_model_name
    return prometheus_client.REGISTRY.get_sample_value(
        name, {"model_name": served, "engine": "0", **labels}
    )


def test_the_prometheus_logger_exposes_them(model_dir: Path) -> None:
    scheduler = nixl_decode_scheduler(model_dir, aux=False)
    logger = PrometheusStatLogger(scheduler.vllm_config)
    failed = "vllm:kv_load_failed_requests_total"
    try:
        logger.record(SchedulerStats(kv_load_failed_reqs={"recomputed": 2}), None)
        logger.record(
            SchedulerStats(kv_load_failed_reqs={"recomputed": 1, "failed": 1}), None
        )
        # Counters add up per outcome; the gauge holds the last value.
        assert sample(failed, scheduler, outcome="recomputed") == 3
        assert sample(failed, scheduler, outcome="failed") == 1
        logger.record(SchedulerStats(kv_transfer_held_reqs=4), None)
        assert sample("vllm:kv_transfer_held_requests", scheduler) == 4
        logger.record(SchedulerStats(), None)
        assert sample("vllm:kv_transfer_held_requests", scheduler) == 0
    finally:
        unregister_vllm_metrics()
