"""MooncakeStoreScheduler after a failed KV load (patch
`end-store-lookups-before-chunks-whose-load-failed`), through a real Scheduler with
kv_load_failure_policy=recompute.

The store's lookup says a chunk exists, its get fails. The Scheduler truncates the
request at the failed block; when that leaves it nothing computed (the failed block
was its first, or the whole load was reported failed), the request is looked up
again, the store still says the chunk exists, and stock code loads it again, step
after step. With the fix the request's later lookups end before its first failed
chunk, and, for a while, so do other requests' lookups of that chunk. The negative
control runs these tests in a separate process with the cap planted away
(tests/v1/kv_connector/test_mooncake_store_load_failure_control.py, in
`make e2e-controls`).

The lookup client is StoreLookupFake (aux_scheduler_utils): its store holds every
full block and answers the longest run of the hashes it is given, recording each
lookup as (num_tokens, number of hashes, rows_from). The test plays the worker: a
load that covers a broken chunk reports that chunk's block as a load error
(invalid_block_ids), as the receive thread does after a failed get. Expected values
are worked out by hand from the block size (16) and the prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.v1.aux_scheduler_utils import (
    StoreLookupFake,
    make_request,
    mooncake_store_scheduler,
    plain_runner_output,
)
from tests.v1.kv_connector.unit.mooncake_store_retry_utils import (
    BS,
    OTHER,
    PROMPT,
    WHOLE,
    Run,
    failures,
    request_fails_at_its_first_chunk,
    started_loads,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput

pytestmark = pytest.mark.usefixtures("scheduler_env")


@pytest.fixture
def store_scheduler(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Scheduler]:
    return mooncake_store_scheduler(
        model_dir, monkeypatch, BS, policy="recompute", aux=False
    )


def test_a_request_whose_first_chunk_fails_is_recomputed_and_finishes(
    store_scheduler: Callable[..., Scheduler],
    caplog: pytest.LogCaptureFixture,
) -> None:
    request_fails_at_its_first_chunk(store_scheduler(), caplog)


def test_another_request_stops_at_the_failed_chunk(
    store_scheduler: Callable[..., Scheduler],
) -> None:
    scheduler = store_scheduler()
    a = make_request("a", PROMPT, block_size=BS)
    scheduler.add_request(a)
    run = Run(scheduler, {a.block_hashes[2]})

    # Step 1: a loads chunks 0-4; chunk 2 fails (reported before a's load
    # finishes on every rank), so a keeps 2 blocks: 32 tokens.
    run.step(hold={"a"}, release=False)
    assert a.num_computed_tokens == 32
    # Step 2: b shares blocks 0-3 with a; a's blocks are not cached yet (its load
    # has not finished), so b has no local hit.
    b = make_request("b", OTHER, block_size=BS)
    assert b.block_hashes[:4] == a.block_hashes[:4]
    scheduler.add_request(b)
    run.step()
    # b's lookup gets the 2 hashes before chunk 2: chunks 0 and 1 still load.
    assert StoreLookupFake.lookups == [WHOLE, (84, 2, None)]
    assert run.loaded == [("a", 0, 5), ("b", 0, 2)]
    assert b.num_computed_tokens == 32
    # Both compute from token 32 and finish; neither loads again.
    run.until_finished({"a", "b"})
    assert set(run.finished) == {"a", "b"}
    assert run.loaded == [("a", 0, 5), ("b", 0, 2)]
    run.step()
    state = failures(scheduler)
    assert state.loads == {} and state.caps == {}
    # The failed chunk is remembered (until it expires), by its hash.
    assert list(state.failed_chunks) == [a.block_hashes[2]]


def test_a_remembered_chunk_expires_and_the_memory_is_bounded(
    store_scheduler: Callable[..., Scheduler],
) -> None:
    scheduler = store_scheduler()
    state = failures(scheduler)
    now = [1000.0]
    state.clock = lambda: now[0]
    state.capacity = 2
    a = make_request("a", PROMPT, block_size=BS)
    b = make_request("b", OTHER, block_size=BS)
    hashes = a.block_hashes[:5]
    for index in (3, 2):
        state.remember(hashes[index])
    # The lookup ends before the first remembered chunk: chunk 2, 2 hashes.
    assert state.cap_lookup(b, hashes, 0) == hashes[:2]
    # Nothing left past the tokens already computed: no lookup at all.
    assert state.cap_lookup(b, hashes, 32) is None
    # A third chunk pushes out the oldest (chunk 3).
    state.remember(hashes[4])
    assert list(state.failed_chunks) == [hashes[2], hashes[4]]
    now[0] += state.ttl_s + 1
    assert state.cap_lookup(b, hashes, 0) == hashes
    assert list(state.failed_chunks) == []


def test_a_request_whose_whole_load_failed_computes_from_its_load_start(
    store_scheduler: Callable[..., Scheduler],
) -> None:
    """Layouts whose block ids are not unique across groups (HMA) report a failed
    load by request (failed_recving); the Scheduler then computes the request from
    token 0. Which chunk failed is unknown: the request's lookups end at its load's
    start, and no chunk is remembered for other requests."""
    scheduler = store_scheduler()
    a = make_request("a", PROMPT, block_size=BS)
    scheduler.add_request(a)
    out = scheduler.schedule()
    assert {r: (c.start, c.stop) for r, (c, _) in started_loads(out).items()} == {
        "a": (0, 5)
    }
    kv = KVConnectorOutput(finished_recving={"a"}, failed_recving={"a"})
    scheduler.update_from_output(out, plain_runner_output(out, kv))
    assert a.num_computed_tokens == 0
    run = Run(scheduler, set())
    run.steps = 1
    run.until_finished({"a"})
    assert run.loaded == []
    assert StoreLookupFake.lookups == [WHOLE]
    assert run.finished == {"a": 4}
    assert list(failures(scheduler).failed_chunks) == []
