"""What the scheduler reports for /metrics about routed-experts rows and KV load
failures (patch `count-routed-experts-rows-and-kv-load-failures-in-metrics`).

Driven through a real Scheduler; each step's SchedulerStats is read from the engine
outputs, as the API server's stat loggers get it. Expected values are derived by hand:
a P/D decode request of 21 prompt tokens holds one emit floor from its first forward
until it finishes; offloaded chunks loaded for positions [20, 80) bring 60 rows; a
failed load is one request per outcome of kv_load_failure_policy. Then vLLM's
PrometheusStatLogger, built from the scheduler's config, records them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from aux_scheduler_utils import (
    make_request,
    nixl_decode_scheduler,
    plain_runner_output,
    runner_output,
)

from tests.v1.core.test_aux_output_pd_scheduler import decode_request
from tests.v1.core.test_kv_load_failure_reason import remote_request
from tests.v1.core.test_offload_rows_scheduler import (
    BS,
    PROMPT,
    admit_load,
    offloaded_and_evicted,
    rows_rejected_output,
)
from vllm.distributed.aux_output_connector.metrics import AuxOutputStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.usefixtures("scheduler_env")


def update(scheduler: Scheduler, out: Any, output: ModelRunnerOutput) -> SchedulerStats:
    engine = scheduler.update_from_output(out, output)
    return next(iter(engine.values())).scheduler_stats


def run_to_end(scheduler: Scheduler) -> list[SchedulerStats]:
    stats = []
    while scheduler.requests:
        out = scheduler.schedule()
        stats.append(update(scheduler, out, runner_output(scheduler, out)))
    return stats


def test_an_emit_floor_is_reported_until_its_request_finishes(model_dir: Path) -> None:
    scheduler = nixl_decode_scheduler(model_dir)
    scheduler.add_request(decode_request("d"))
    out = scheduler.schedule()  # waiting for the pull
    pulled = runner_output(scheduler, out, recving={"d"})
    # The pull is in flight: tracked, no floor yet.
    assert update(scheduler, out, pulled).aux_output_stats == AuxOutputStats(
        rows_loaded=0, emit_floors=0, tracked_requests=1
    )
    per_step = [s.aux_output_stats for s in run_to_end(scheduler)]
    assert len(per_step) == 3  # three tokens
    # From the first forward: one floor, one tracked request ...
    assert [(s.emit_floors, s.tracked_requests) for s in per_step[:-1]] == [(1, 1)] * 2
    # ... and nothing once it finished (the leak check reads this).
    assert (per_step[-1].emit_floors, per_step[-1].tracked_requests) == (0, 0)
    # Without rows transfer no rows arrive with the KV.
    assert {s.rows_loaded for s in per_step} == {0}


def test_an_aborted_request_leaves_nothing_tracked(model_dir: Path) -> None:
    scheduler = nixl_decode_scheduler(model_dir)
    scheduler.add_request(decode_request("d", max_tokens=10))
    out = scheduler.schedule()
    update(scheduler, out, runner_output(scheduler, out, recving={"d"}))
    out = scheduler.schedule()
    assert update(scheduler, out, runner_output(scheduler, out)).aux_output_stats == (
        AuxOutputStats(rows_loaded=0, emit_floors=1, tracked_requests=1)
    )
    scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert scheduler.make_stats().aux_output_stats == AuxOutputStats(0, 0, 0)


def test_rows_that_arrive_with_offloaded_chunks_are_counted(model_dir: Path) -> None:
    scheduler = offloaded_and_evicted(model_dir)
    scheduler.make_stats()  # drop what the set-up counted
    b = make_request("b", PROMPT, block_size=BS, prompt_start=20)
    out, (job_id, _) = admit_load(scheduler, b)
    output = runner_output(scheduler, out)
    output.kv_connector_output = KVConnectorOutput(
        finished_recving={"b"},
        kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs={job_id: 1}),
    )
    assert update(scheduler, out, output).aux_output_stats.rows_loaded == 0
    # The request resumes in the next step, and its rows are queued for import:
    # five chunks of 16 loaded, rows emitted from 20, positions [20, 80).
    out = scheduler.schedule()
    stats = update(scheduler, out, runner_output(scheduler, out))
    assert stats.aux_output_stats.rows_loaded == 60
    assert stats.kv_load_failed_reqs == {}
    # A counter: the next snapshot starts from 0.
    assert scheduler.make_stats().aux_output_stats.rows_loaded == 0


def test_a_row_check_failure_is_a_recomputed_kv_load_failure(model_dir: Path) -> None:
    scheduler = offloaded_and_evicted(model_dir)
    scheduler.make_stats()
    out, (job_id, _) = admit_load(scheduler, make_request("b", PROMPT, block_size=BS))
    output = rows_rejected_output(scheduler, out, job_id, 2)
    assert update(scheduler, out, output).kv_load_failed_reqs == {"recomputed": 1}
    out = scheduler.schedule()
    stats = update(scheduler, out, runner_output(scheduler, out))
    assert stats.kv_load_failed_reqs == {}  # counted once
    # Blocks 0-1 stay loaded: their 32 rows are imported, the rest recomputed.
    assert stats.aux_output_stats.rows_loaded == 32


@pytest.mark.parametrize(
    ("policy", "outcome"), [("fail", "failed"), ("recompute", "recomputed")]
)
def test_a_failed_pull_is_counted_by_outcome(
    model_dir: Path, policy: str, outcome: str
) -> None:
    """With routed experts off too: the counter is about KV, not rows."""
    scheduler = nixl_decode_scheduler(model_dir, policy, aux=False)
    scheduler.add_request(remote_request("d"))
    out = scheduler.schedule()
    failed = KVConnectorOutput(finished_recving={"d"}, failed_recving={"d"})
    stats = update(scheduler, out, plain_runner_output(out, failed))
    assert stats.kv_load_failed_reqs == {outcome: 1}
    assert stats.aux_output_stats is None  # routed experts off: no such metrics
    # Negative control: a pull that succeeds counts nothing.
    scheduler.add_request(remote_request("e"))
    out = scheduler.schedule()
    done = KVConnectorOutput(finished_recving={"e"})
    assert (
        update(scheduler, out, plain_runner_output(out, done)).kv_load_failed_reqs == {}
    )


def sample(name: str, scheduler: Scheduler, **labels: str) -> float | None:
    served = scheduler.vllm_config.model_config.served_model_name
    return prometheus_client.REGISTRY.get_sample_value(
        name, {"model_name": served, "engine": "0", **labels}
    )


def test_the_prometheus_logger_exposes_them(model_dir: Path) -> None:
    scheduler = nixl_decode_scheduler(model_dir)
    logger = PrometheusStatLogger(scheduler.vllm_config)
    try:
        logger.record(
            SchedulerStats(
                aux_output_stats=AuxOutputStats(60, 2, 3),
                kv_load_failed_reqs={"recomputed": 2},
            ),
            None,
        )
        logger.record(
            SchedulerStats(aux_output_stats=AuxOutputStats(5, 0, 0)),
            None,
        )
        # Counters add up; gauges hold the last value.
        assert sample("vllm:routed_experts_rows_loaded_total", scheduler) == 65
        assert sample("vllm:routed_experts_emit_floors", scheduler) == 0
        assert sample("vllm:routed_experts_tracked_requests", scheduler) == 0
        failed = "vllm:kv_load_failed_requests_total"
        assert sample(failed, scheduler, outcome="recomputed") == 2
        assert sample(failed, scheduler, outcome="failed") == 0
    finally:
        unregister_vllm_metrics()


def test_without_routed_experts_only_the_kv_load_failures_are_exposed(
    model_dir: Path,
) -> None:
    scheduler = nixl_decode_scheduler(model_dir, aux=False)
    logger = PrometheusStatLogger(scheduler.vllm_config)
    try:
        logger.record(SchedulerStats(kv_load_failed_reqs={"failed": 1}), None)
        assert sample("vllm:routed_experts_emit_floors", scheduler) is None
        assert sample("vllm:routed_experts_rows_loaded_total", scheduler) is None
        failed = "vllm:kv_load_failed_requests_total"
        assert sample(failed, scheduler, outcome="failed") == 1
    finally:
        unregister_vllm_metrics()
