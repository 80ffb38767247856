"""What the scheduler reports for /metrics about routed-experts rows and the state of
the routed-experts control plane (patch
`count-routed-experts-rows-and-control-plane-state`), and how KV load failures and
held hand-offs (counted by `count-kv-load-failures-and-requests-held-for-kv`) look
with routed experts on.

Driven through a real Scheduler; each step's SchedulerStats is read from the engine
outputs, as the API server's stat loggers get it. Expected values are derived by hand:
a P/D decode request of 21 prompt tokens holds one emit floor from its first forward
until it finishes; offloaded chunks loaded for positions [20, 80) bring 60 rows; a
rejected chunk is one recomputed KV load failure; offloaded chunks
past where the routed-experts limit stops a load are withheld tokens; a prefill
hand-off holds its blocks until decode has read them. Then vLLM's
PrometheusStatLogger, built from the scheduler's config, records them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import prometheus_client
import pytest

from tests.v1.aux_scheduler_utils import (
    make_request,
    nixl_decode_scheduler,
    offload_scheduler,
    plain_runner_output,
    runner_output,
)
from tests.v1.core.nixl_lease_scheduler_utils import (
    finish_sending,
    hand_off,
    producer,
)
from tests.v1.core.offload_rows_scheduler_utils import (
    BS,
    PROMPT,
    admit_load,
    finish_reporting,
    offloaded_and_evicted,
    rows_rejected_output,
    rows_scheduler,
)
from tests.v1.core.pd_scheduler_utils import decode_request
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


WITHHELD = "vllm:kv_offload_routed_experts_withheld_tokens"


def offloaded(model_dir: Path, rowless: frozenset[int] | None = None) -> Scheduler:
    """PROMPT's five full chunks offloaded and its GPU blocks reallocated (12
    blocks; each 176 fresh tokens take 11). `rowless`: the rows switch on, and these
    chunks stored without rows; None: the switch off (0006's prompt-start limit)."""
    if rowless is None:
        scheduler = offload_scheduler(model_dir, block_size=BS)
    else:
        scheduler = rows_scheduler(model_dir, num_blocks=12)
    finish_reporting(
        scheduler, make_request("a", PROMPT, block_size=BS), rowless or frozenset()
    )
    # 0.33.0 also keeps the rows of 2 x 12 evicted blocks (Request.aux_output_max_hit):
    # 33 fresh blocks push "a"'s out.
    for i in range(3):
        fresh = [400 + 176 * i + t for t in range(176)]
        finish_reporting(
            scheduler, make_request(f"f{i}", fresh, block_size=BS, max_tokens=1)
        )
    withheld(scheduler)  # drop what the set-up counted
    return scheduler


def withheld(scheduler: Scheduler) -> int:
    """The counter's increase since the last call (the connector's own stats)."""
    assert scheduler.connector is not None
    stats = scheduler.connector.get_kv_connector_stats()
    return int(stats.reduce().get(WITHHELD, 0)) if stats is not None else 0


def loaded_tokens(out: Any) -> int:
    """Tokens the step's offload loads write: their destination GPU blocks."""
    jobs = out.kv_connector_metadata.load_jobs.values()
    return sum(len(job.dst_spec.block_ids) for job in jobs) * BS


# The tier holds chunks 0-4 (positions [0, 80)); a load may reach 83 (the last
# prompt token is computed). The limit (0006) ends loads at floor(s / 16) * 16.
@pytest.mark.parametrize(
    ("prompt_start", "loaded", "expected"),
    [(40, 32, 48), (0, 0, 80), (20, 16, 64), (80, 80, 0), (84, 80, 0)],
)
def test_offloaded_tokens_the_routed_experts_limit_withholds_are_counted(
    model_dir: Path, prompt_start: int, loaded: int, expected: int
) -> None:
    scheduler = offloaded(model_dir)
    scheduler.add_request(
        make_request("b", PROMPT, block_size=BS, prompt_start=prompt_start)
    )
    out = scheduler.schedule()
    assert loaded_tokens(out) == loaded
    assert withheld(scheduler) == expected
    # Counted once: the steps that follow add nothing.
    scheduler.update_from_output(out, runner_output(scheduler, out))
    scheduler.schedule()
    assert withheld(scheduler) == 0


def finish_plain(scheduler: Scheduler, request: Any) -> None:
    """Run `request` to the end with routed experts off, its stores reported done."""
    scheduler.add_request(request)
    pending: dict[int, Any] = {}
    while request.request_id in scheduler.requests or pending:
        out = scheduler.schedule()
        done = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(pending, 1))
        pending = dict(out.kv_connector_metadata.store_jobs)
        kv = KVConnectorOutput(kv_connector_worker_meta=done)
        scheduler.update_from_output(out, plain_runner_output(out, kv))


def test_without_routed_experts_nothing_is_withheld(model_dir: Path) -> None:
    """Negative control: the same traffic loads all five chunks."""
    scheduler = offload_scheduler(model_dir, block_size=BS, aux=False)
    for request in (
        make_request("a", PROMPT, block_size=BS),
        make_request("fresh", list(range(1000, 1176)), block_size=BS, max_tokens=1),
    ):
        finish_plain(scheduler, request)
    withheld(scheduler)
    scheduler.add_request(make_request("b", PROMPT, block_size=BS))
    out = scheduler.schedule()
    assert loaded_tokens(out) == 80
    assert withheld(scheduler) == 0


@pytest.mark.parametrize(
    ("rowless", "loaded", "expected"), [({2}, 32, 48), ((), 80, 0)]
)
def test_with_rows_only_chunks_without_rows_withhold(
    model_dir: Path, rowless: set[int], loaded: int, expected: int
) -> None:
    """Rows switch on, a load from 0: chunk 2 stored without rows stops it there,
    and chunks 2-4, in the tier, are 48 tokens withheld. All with rows: none."""
    scheduler = offloaded(model_dir, rowless=frozenset(rowless))
    out, _ = admit_load(scheduler, make_request("b", PROMPT, block_size=BS))
    assert loaded_tokens(out) == loaded
    assert withheld(scheduler) == expected


def test_a_hand_off_whose_lease_expired_is_no_longer_held(model_dir: Path) -> None:
    """vllm:kv_transfer_held_requests (kv-transfer-metrics, tested there with
    completed sends) on a prefill instance with lease generations: a hand-off that
    decode never read stops being held when its lease expires."""
    scheduler = producer(model_dir)
    hand_off(scheduler, "a")
    assert scheduler.make_stats().kv_transfer_held_reqs == 1
    finish_sending(scheduler, "a", expired=True)
    assert scheduler.make_stats().kv_transfer_held_reqs == 0


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
        logger.record(SchedulerStats(kv_transfer_held_reqs=4), None)
        assert sample("vllm:kv_transfer_held_requests", scheduler) == 4
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
