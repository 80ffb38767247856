"""The offloading scheduler of the rows tests and the worker side the test plays,
for the offloaded-rows scheduler tests (test_offload_rows_scheduler.py,
tests/v1/metrics): store jobs reported finished with the rows positions a real
output rank would report, loads admitted, rows rejected. bs = 16; the request's
prompt is 5 full blocks and 4 more tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.v1.aux_scheduler_utils import make_request, offload_scheduler, runner_output
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

BS = 16
PROMPT = [(7 * i) % 300 + 4 for i in range(84)]  # blocks 0-4 full, 4 tokens more


def rows_scheduler(
    model_dir: Path,
    switch: bool = True,
    policy: str = "recompute",
    num_blocks: int = 100,
    **extra: Any,
) -> Scheduler:
    return offload_scheduler(
        model_dir,
        block_size=BS,
        num_blocks=num_blocks,
        rows_transfer=switch,
        policy=policy,
        **extra,
    )


def finish_reporting(
    scheduler: Scheduler, request: Request, rowless_chunks: frozenset[int] = frozenset()
) -> list[Any]:
    """Run `request` to the end; report each store job done, with rows for every chunk
    but `rowless_chunks` (indices into the request's blocks). Returns the store jobs."""
    scheduler.add_request(request)
    jobs: list[Any] = []
    pending: dict[int, Any] = {}
    while request.request_id in scheduler.requests or pending:
        out = scheduler.schedule()
        meta = OffloadingWorkerMetadata()
        for job_id, job in pending.items():
            meta.completed_jobs[job_id] = 1
            meta.rows_stored[job_id] = tuple(
                s.position
                for s in job.rows_sources
                if request.block_hashes.index(s.block_hashes[0]) not in rowless_chunks
            )
        pending = dict(out.kv_connector_metadata.store_jobs)
        jobs += pending.values()
        output = runner_output(scheduler, out)
        output.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=meta)
        scheduler.update_from_output(out, output)
    return jobs


def offloaded_and_evicted(model_dir: Path) -> Scheduler:
    """The prompt's chunks offloaded with rows, and its GPU blocks reallocated: 12
    blocks, and 176 fresh tokens take 11 of them."""
    scheduler = rows_scheduler(model_dir, num_blocks=12)
    finish_reporting(scheduler, make_request("a", PROMPT, block_size=BS))
    fresh = list(range(1000, 1176))
    finish_reporting(
        scheduler, make_request("fresh", fresh, block_size=BS, max_tokens=1)
    )
    return scheduler


def admit_load(scheduler: Scheduler, request: Request) -> tuple[Any, Any]:
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ((job_id, job),) = out.kv_connector_metadata.load_jobs.items()
    return out, (job_id, job)


def rows_rejected_output(
    scheduler: Scheduler, out: Any, job_id: int, chunk: int
) -> ModelRunnerOutput:
    """The load job `job_id` of request "b" finished, and the rows of its `chunk`
    failed their check: the chunk's block is a KV load error."""
    block_ids = scheduler.kv_cache_manager.get_block_ids("b")[0]
    output = runner_output(scheduler, out)
    output.kv_connector_output = KVConnectorOutput(
        finished_recving={"b"},
        invalid_block_ids={block_ids[chunk]},
        kv_connector_worker_meta=OffloadingWorkerMetadata(
            completed_jobs={job_id: 1}, rows_rejected={job_id: (chunk,)}
        ),
    )
    return output
