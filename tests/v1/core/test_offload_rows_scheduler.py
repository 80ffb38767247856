"""Rows that travel with offloaded chunks, through a real Scheduler and the native
OffloadingConnector's scheduler side (patch
`carry-routed-experts-rows-with-offloaded-kv-chunks`).

The worker side is played by the test: it takes the store and load jobs from each
step's connector metadata, and reports them finished with the rows positions a real
output rank would report. bs = 16; the request's prompt is 5 full blocks and 4 more
tokens. Expected hit lengths, positions and chains are derived by hand from the rule
(a chunk holding a position whose rows the request emits is a hit only with rows);
chains from hashlib (tests.rows_spec.spec_chains).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.rows_spec import spec_chains
from tests.v1.aux_scheduler_utils import make_request, runner_output, step
from tests.v1.core.offload_rows_scheduler_utils import (
    BS,
    PROMPT,
    admit_load,
    finish_reporting,
    offloaded_and_evicted,
    rows_rejected_output,
    rows_scheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

pytestmark = [pytest.mark.usefixtures("scheduler_env")]


def hits(scheduler: Scheduler, request: Request, num_computed: int = 0) -> int | None:
    scheduler.add_request(request)
    return scheduler.connector.get_num_new_matched_tokens(request, num_computed)[0]


def test_store_jobs_say_where_each_chunks_rows_are(model_dir: Path) -> None:
    scheduler = rows_scheduler(model_dir)
    first = make_request("a", PROMPT, block_size=BS, max_tokens=2)
    jobs = finish_reporting(scheduler, first)
    sources = [s for job in jobs for s in job.rows_sources]
    chains = spec_chains(first.all_token_ids, BS)
    # Every full block of the prompt and the output, each once, with its own chain.
    stored = sorted(first.block_hashes.index(s.block_hashes[0]) for s in sources)
    assert stored == [0, 1, 2, 3, 4]
    for source in sources:
        index = first.block_hashes.index(source.block_hashes[0])
        assert source.block_hashes == (first.block_hashes[index],)
        assert source.chain == chains[index]


@pytest.mark.parametrize(
    ("rowless", "prompt_start", "expected"),
    [
        (frozenset(), 0, 80),  # every chunk has rows: the whole offloaded prefix
        (frozenset({3}), 0, 48),  # the hit ends at the first chunk without rows
        (frozenset({0}), 0, 0),
        (frozenset({0, 1}), 40, 80),  # chunks wholly before s load without rows
        (frozenset({0, 1, 2}), 40, 32),  # chunk 2 holds s = 40: it needs rows
        (frozenset({1}), 20, 16),
        (frozenset({1}), 83, 80),  # s past every stored chunk: no rows needed
    ],
)
def test_a_chunk_past_the_floor_is_a_hit_only_with_rows(
    model_dir: Path, rowless: frozenset[int], prompt_start: int, expected: int
) -> None:
    scheduler = rows_scheduler(model_dir)
    finish_reporting(scheduler, make_request("a", PROMPT, block_size=BS), rowless)
    again = make_request("b", PROMPT, block_size=BS, prompt_start=prompt_start)
    assert hits(scheduler, again) == expected


def test_without_the_switch_rows_from_0_load_nothing(model_dir: Path) -> None:
    """Negative control: the same traffic without the switch keeps the old limit."""
    scheduler = rows_scheduler(model_dir, switch=False)
    finish_reporting(scheduler, make_request("a", PROMPT, block_size=BS))
    assert hits(scheduler, make_request("b", PROMPT, block_size=BS)) == 0


def test_a_worker_that_reports_no_rows_leaves_no_hits(model_dir: Path) -> None:
    """Fail closed: chunks whose store came back without rows positions."""
    scheduler = rows_scheduler(model_dir)
    finish_reporting(
        scheduler, make_request("a", PROMPT, block_size=BS), frozenset(range(5))
    )
    assert hits(scheduler, make_request("b", PROMPT, block_size=BS)) == 0


def test_a_load_carries_the_checks_and_its_rows_are_imported(model_dir: Path) -> None:
    scheduler = offloaded_and_evicted(model_dir)
    b = make_request("b", PROMPT, block_size=BS, prompt_start=20)
    out, (job_id, job) = admit_load(scheduler, b)
    block_ids = scheduler.kv_cache_manager.get_block_ids("b")[0]
    chains = spec_chains(PROMPT, BS)
    # Rows from 20: block 0 needs none, block 1 needs [4, 16), blocks 2-4 all.
    assert [
        (c.position, c.check.block_id, c.check.need_lo, c.check.need_hi)
        for c in job.rows_checks
    ] == [
        (1, block_ids[1], 4, 16),
        (2, block_ids[2], 0, 16),
        (3, block_ids[3], 0, 16),
        (4, block_ids[4], 0, 16),
    ]
    assert [c.check.chain for c in job.rows_checks] == chains[1:5]

    output = runner_output(scheduler, out)
    output.kv_connector_output = KVConnectorOutput(
        finished_recving={"b"},
        kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs={job_id: 1}),
    )
    scheduler.update_from_output(out, output)
    out = scheduler.schedule()
    rows_import = out.aux_output_connector_metadata.rows_imports["b"]
    assert (rows_import.start, rows_import.end) == (20, 80)
    assert rows_import.block_ids == tuple(block_ids[1:5])


def test_rows_that_fail_their_check_are_recomputed_and_stop_later_hits(
    model_dir: Path,
) -> None:
    scheduler = offloaded_and_evicted(model_dir)
    b = make_request("b", PROMPT, block_size=BS)
    out, (job_id, job) = admit_load(scheduler, b)
    scheduler.update_from_output(out, rows_rejected_output(scheduler, out, job_id, 2))
    out = scheduler.schedule()
    # Recompute policy: the valid prefix (blocks 0-1) stays, block 2 on is computed.
    assert out.num_scheduled_tokens["b"] == 84 - 32
    rows_import = out.aux_output_connector_metadata.rows_imports["b"]
    assert (rows_import.start, rows_import.end) == (0, 32)
    scheduler.update_from_output(out, runner_output(scheduler, out))
    while "b" in scheduler.requests:
        step(scheduler)
    # The chunk whose rows failed no longer counts as one with rows.
    assert hits(scheduler, make_request("c", PROMPT, block_size=BS)) == 32


def test_a_prefix_cache_reset_forgets_every_chunks_rows(model_dir: Path) -> None:
    scheduler = rows_scheduler(model_dir)
    finish_reporting(scheduler, make_request("a", PROMPT, block_size=BS))
    assert scheduler.reset_prefix_cache(reset_connector=True)
    assert hits(scheduler, make_request("b", PROMPT, block_size=BS)) == 0


def test_a_layout_whose_chunks_cannot_carry_rows_is_refused_at_startup(
    model_dir: Path,
) -> None:
    with pytest.raises(ValueError) as info:
        rows_scheduler(model_dir, blocks_per_chunk=2)
    message = str(info.value)
    assert "enable_routed_experts_transfer" in message
    assert "a chunk holds 2 KV blocks, not one" in message
    assert "Remove enable_routed_experts_transfer" in message


class RenamedCPUOffloadingSpec(CPUOffloadingSpec):
    """An out-of-tree spec under another name that keeps the CPU tier's rows slots."""


class SlotlessOffloadingSpec(CPUOffloadingSpec):
    """An out-of-tree spec whose chunks cannot carry rows: it declares no slots."""

    def routed_experts_rows_slots(self) -> int | None:
        return None


def test_a_spec_under_another_name_that_declares_slots_carries_rows(
    model_dir: Path,
) -> None:
    scheduler = rows_scheduler(
        model_dir, spec_name="RenamedCPUOffloadingSpec", spec_module_path=__name__
    )
    # It behaves as the native tier: a stored chunk with rows is a hit.
    finish_reporting(scheduler, make_request("a", PROMPT, block_size=BS))
    assert hits(scheduler, make_request("b", PROMPT, block_size=BS)) == 5 * BS


def test_a_spec_that_declares_no_slots_is_refused_with_the_switch(
    model_dir: Path,
) -> None:
    with pytest.raises(ValueError) as info:
        rows_scheduler(
            model_dir, spec_name="SlotlessOffloadingSpec", spec_module_path=__name__
        )
    assert (
        "the offloading spec SlotlessOffloadingSpec keeps no rows slots for its "
        "chunks (OffloadingSpec.routed_experts_rows_slots)"
    ) in str(info.value)


def test_a_spec_that_declares_no_slots_serves_without_the_switch(
    model_dir: Path,
) -> None:
    scheduler = rows_scheduler(
        model_dir,
        switch=False,
        spec_name="SlotlessOffloadingSpec",
        spec_module_path=__name__,
    )
    assert scheduler.connector is not None


def test_sync_loads_are_refused_with_the_switch(model_dir: Path) -> None:
    """On vLLM 0.33, sync loads land in the step that runs the request, before its
    rows could be imported. vLLM 0.31 has no sync loads (its counterpart: every
    load in this file is async)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler

    if "sync_load_budget_bytes" not in scheduler.SchedulerOffloadConfig._fields:
        pytest.skip("this base has no sync offload loads")
    with pytest.raises(ValueError, match="sync loads are on"):
        rows_scheduler(model_dir, sync_load_budget_bytes=1 << 20)
    rows_scheduler(model_dir, switch=False, sync_load_budget_bytes=1 << 20)


def counted_rows_checks(scheduler: Scheduler, request: Request) -> list[int]:
    """Record which of `request`'s chunks the rows-aware limit asks the index
    about (`has_rows` by key; with secondary tiers, `chunk_has_rows`)."""
    from vllm.v1.kv_offload.base import make_offload_key

    index = scheduler.connector.connector_scheduler._rows
    chunk_of = {make_offload_key(h, 0): i for i, h in enumerate(request.block_hashes)}
    asked: list[int] = []
    for name in ("has_rows", "chunk_has_rows"):
        real = getattr(index, name, None)
        if real is None:  # chunk_has_rows comes with the secondary tiers
            continue

        def spy(key: bytes, *args: Any, real: Any = real) -> Any:
            asked.append(chunk_of[key])
            return real(key, *args)

        setattr(index, name, spy)
    return asked


def test_a_waiting_requests_walk_resumes_where_it_stopped(model_dir: Path) -> None:
    """A waiting request asks for its limit every step; the walk over its chunks
    resumes at the chunk that stopped it, so a step costs that chunk, not the
    prompt's length."""
    scheduler = rows_scheduler(model_dir)
    finish_reporting(scheduler, make_request("a", PROMPT, block_size=BS), {3})
    b = make_request("b", PROMPT, block_size=BS)
    asked = counted_rows_checks(scheduler, b)
    limit = scheduler.connector.connector_scheduler.rows_load_limit
    assert limit(b, 0) == 48
    assert asked == [0, 1, 2, 3]
    asked.clear()
    assert limit(b, 0) == 48
    assert asked == [3]  # chunks 0-2 had rows and lost none since
    # Another request walks its own chunks from the start.
    asked.clear()
    assert limit(make_request("c", PROMPT, block_size=BS), 0) == 48
    assert asked == [0, 1, 2, 3]


@pytest.mark.parametrize("planted_fault", [False, True])
def test_a_chunk_that_loses_its_rows_restarts_the_walk(
    model_dir: Path, planted_fault: bool
) -> None:
    """A chunk the last walk passed loses its rows (evicted, or its rows failed a
    load check): the next walk starts over and stops there. Planted fault: the
    index forgets the rows without saying a chunk lost them, and the resumed
    walk keeps the stale limit."""
    from vllm.v1.kv_offload.base import make_offload_key

    scheduler = rows_scheduler(model_dir)
    finish_reporting(scheduler, make_request("a", PROMPT, block_size=BS))
    index = scheduler.connector.connector_scheduler._rows
    b = make_request("b", PROMPT, block_size=BS)
    limit = scheduler.connector.connector_scheduler.rows_load_limit
    assert limit(b, 0) == 80
    if planted_fault:
        index._lose_rows = index._keys_with_rows.difference_update
    index.forget([make_offload_key(b.block_hashes[1], 0)])
    assert limit(b, 0) == (80 if planted_fault else 16)
