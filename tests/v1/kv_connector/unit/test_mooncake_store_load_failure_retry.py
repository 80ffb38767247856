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
from typing import Any

import pytest
from aux_scheduler_utils import (
    StoreLookupFake,
    make_request,
    mooncake_store_scheduler,
    plain_runner_output,
    runner_output,
)

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.usefixtures("scheduler_env")

BS = 16
PROMPT = [(13 * i) % 400 + 4 for i in range(84)]  # 5 full blocks + 4 tokens
OTHER = PROMPT[:64] + [5] * 20  # the same blocks 0-3, then another block 4
# A lookup of a whole 84-token prompt: 5 hashes; the store holds all 5 full blocks,
# so the hit is 80 tokens, chunks 0-4.
WHOLE = (84, 5, None)


@pytest.fixture
def store_scheduler(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Scheduler]:
    return mooncake_store_scheduler(
        model_dir, monkeypatch, BS, policy="recompute", aux=False
    )


def started_loads(out: Any) -> dict[str, tuple[range, list[int]]]:
    """The loads this step's metadata starts: request id -> (chunk indices, the
    request's block ids)."""
    loads = {}
    for req_meta in out.kv_connector_metadata.requests:
        spec = req_meta.load_spec
        if spec is not None and spec.can_load:
            chunks = range(
                spec.vllm_cached_tokens // BS, -(-spec.kvpool_cached_tokens // BS)
            )
            loads[req_meta.req_id] = (chunks, req_meta.block_ids[0])
    return loads


class Run:
    """Steps a scheduler, playing the worker: every load finishes in the step
    that starts it (unless held), and a load that covers a broken chunk reports
    that chunk's block as a load error."""

    def __init__(self, scheduler: Scheduler, broken: set[bytes], aux: bool = False):
        self.scheduler, self.broken, self.aux = scheduler, broken, aux
        self.loaded: list[tuple[str, int, int]] = []  # (request, first chunk, end)
        self.finished: dict[str, int] = {}  # request -> the step it finished in
        self.steps = 0
        self.held: dict[str, tuple[range, list[int]]] = {}

    def step(self, hold: set[str] = frozenset(), release: bool = True) -> None:
        scheduler = self.scheduler
        out = scheduler.schedule()
        self.steps += 1
        invalid: set[int] = set()
        loads = started_loads(out)
        for req_id, (chunks, block_ids) in loads.items():
            self.loaded.append((req_id, chunks.start, chunks.stop))
            hashes = scheduler.requests[req_id].block_hashes
            bad = [i for i in chunks if hashes[i] in self.broken]
            if bad:
                invalid.add(block_ids[bad[0]])
        recving = {r for r in loads if r not in hold}
        self.held.update({r: loads[r] for r in loads if r in hold})
        if release:
            recving |= set(self.held)
            self.held.clear()
        if self.aux:
            output = runner_output(scheduler, out, recving=recving, invalid=invalid)
        else:
            kv = KVConnectorOutput(finished_recving=recving, invalid_block_ids=invalid)
            output = plain_runner_output(out, kv)
        engine = scheduler.update_from_output(out, output)
        for outputs in engine.values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.finished.setdefault(o.request_id, self.steps)

    def until_finished(self, req_ids: set[str], max_steps: int = 12) -> None:
        while not req_ids <= set(self.finished) and self.steps < max_steps:
            self.step()


def failures(scheduler: Scheduler) -> Any:
    return scheduler.connector.connector_scheduler._load_failures


def stop_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings that a chunk no longer counts for a request."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.endswith("load_failures") and r.levelname == "WARNING"
    ]


@pytest.mark.parametrize("aux", [False, True])
def test_a_request_whose_first_chunk_fails_is_recomputed_and_finishes(
    store_scheduler: Callable[..., Scheduler],
    caplog: pytest.LogCaptureFixture,
    aux: bool,
) -> None:
    # With routed experts on, a request that returns no prompt rows (start 84) is
    # looked up in full too: the same lookups, the same loads.
    scheduler = store_scheduler(aux=aux)
    a = make_request("a", PROMPT, block_size=BS, prompt_start=len(PROMPT))
    scheduler.add_request(a)
    run = Run(scheduler, {a.block_hashes[0]}, aux=aux)

    # Step 1: chunks 0-4 load; chunk 0 fails, so nothing stays computed.
    run.step()
    assert a.num_computed_tokens == 0
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # The load is over (finished_recving); the request's lookups end at token 0.
    assert failures(scheduler).loads == {}
    assert failures(scheduler).caps == {"a": 0}
    # Step 2: the request's lookup ends before chunk 0, so none is made; the whole
    # prompt (84 tokens) is computed and samples its first token. Steps 3 and 4
    # sample the other two (max_tokens=3).
    run.until_finished({"a"})
    assert run.loaded == [("a", 0, 5)]
    assert StoreLookupFake.lookups == [WHOLE]
    assert run.finished == {"a": 4}
    assert len(stop_warnings(caplog)) == 1
    assert "request a failed at token 0" in stop_warnings(caplog)[0]
    # The next step's metadata drops the finished request's state.
    run.step()
    assert failures(scheduler).loads == {}
    assert failures(scheduler).caps == {}


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
