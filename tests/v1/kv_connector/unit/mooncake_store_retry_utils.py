"""Shared by the Mooncake store's failed-load tests (patch
`end-store-lookups-before-chunks-whose-load-failed`): the prompts, and a driver
that steps a real Scheduler and plays the worker of its loads.

Expected values are worked out by hand from the block size (16) and the prompts.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.v1.aux_scheduler_utils import (
    StoreLookupFake,
    make_request,
    plain_runner_output,
    runner_output,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

BS = 16
PROMPT = [(13 * i) % 400 + 4 for i in range(84)]  # 5 full blocks + 4 tokens
OTHER = PROMPT[:64] + [5] * 20  # the same blocks 0-3, then another block 4
# A lookup of a whole 84-token prompt: 5 hashes; the store holds all 5 full blocks,
# so the hit is 80 tokens, chunks 0-4.
WHOLE = (84, 5, None)


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


def request_fails_at_its_first_chunk(
    scheduler: Scheduler, caplog: pytest.LogCaptureFixture
) -> None:
    """A request whose first chunk's load fails is recomputed and finishes: its
    lookups end at token 0 after the failure, so the chunk is loaded once."""
    aux = scheduler.aux_output_connector is not None
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
