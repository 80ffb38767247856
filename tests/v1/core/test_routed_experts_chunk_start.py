"""Which routed-experts chunks a real Scheduler sends a start with (patch
`return-the-absolute-start-position-of-routed-experts`).

A request's first chunk carries its absolute start; a chunk that continues the
previous one carries none (the output processor continues it from the previous
end); a chunk that does not continue it (a worker that re-emits or skips a
position) carries its own start, which the output processor then refuses. Fed
through the output processor's accumulation, the starts must reproduce the
positions a hand derivation gives: rows from the prompt start to P + C - 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.v1.aux_scheduler_utils import make_request, make_scheduler, runner_output
from vllm.config import KVTransferConfig
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.output_processor import RequestState

pytestmark = pytest.mark.usefixtures("scheduler_env")

PROMPT = 20


def colocated_scheduler(model_dir: Path) -> Scheduler:
    return make_scheduler(
        model_dir, KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    )


def output_state(request_id: str) -> RequestState:
    # Only the accumulation under test (add_routed_experts) is exercised.
    state = object.__new__(RequestState)
    state.request_id = request_id
    state.external_req_id = request_id
    state.routed_experts_chunks = []
    state.routed_experts_start = None
    state.routed_experts_end = None
    return state


def run(
    scheduler: Scheduler, shift_at_step: int | None = None
) -> list[tuple[int | None, int]]:
    """Steps until the request finishes; returns (start sent, rows) per output.
    With `shift_at_step`, the worker's rows of that step start one position early
    (a planted re-emitted row)."""
    chunks: list[tuple[int | None, int]] = []
    step = 0
    while scheduler.requests:
        out = scheduler.schedule()
        worker = runner_output(scheduler, out)
        if step == shift_at_step:
            aux: dict[str, Any] = worker.aux_output_connector_output
            for rid, piece in aux.items():
                start = piece.token_start - 1
                aux[rid] = AuxRequestOutput(
                    start, np.full((len(piece.rows) + 1, 2, 2), 7, np.uint8)
                )
        engine = scheduler.update_from_output(out, worker)
        for outputs in engine.values():
            for o in outputs.outputs:
                if o.routed_experts is not None:
                    chunks.append((o.routed_experts_start, len(o.routed_experts)))
        step += 1
    return chunks


@pytest.mark.parametrize("prompt_start", [0, 5])
def test_only_the_first_chunk_carries_a_start(
    model_dir: Path, prompt_start: int
) -> None:
    scheduler = colocated_scheduler(model_dir)
    scheduler.add_request(
        make_request(
            "r", list(range(4, 4 + PROMPT)), max_tokens=4, prompt_start=prompt_start
        )
    )
    chunks = run(scheduler)
    # Hand-derived: the prefill step returns rows [s, P) (the last prompt token's
    # row included), each of the 3 later steps one row; P + C - 1 = 23 positions.
    assert chunks == [
        (prompt_start, PROMPT - prompt_start),
        (None, 1),
        (None, 1),
        (None, 1),
    ]
    state = output_state("r")
    for start, n in chunks:
        state.add_routed_experts(np.zeros((n, 2, 2), np.uint8), start)
    assert (state.routed_experts_start, state.routed_experts_end) == (
        prompt_start,
        PROMPT + 4 - 1,
    )


def test_a_chunk_that_does_not_continue_carries_its_start_and_is_refused(
    model_dir: Path,
) -> None:
    # Negative control: the same request with the worker re-emitting one row at
    # the second decode step. The scheduler must not hide it as a continuation.
    scheduler = colocated_scheduler(model_dir)
    scheduler.add_request(make_request("r", list(range(4, 4 + PROMPT)), max_tokens=4))
    chunks = run(scheduler, shift_at_step=2)
    assert chunks == [(0, PROMPT), (None, 1), (PROMPT, 2), (None, 1)]
    state = output_state("r")
    state.add_routed_experts(np.zeros((PROMPT, 2, 2), np.uint8), 0)
    state.add_routed_experts(np.zeros((1, 2, 2), np.uint8), None)
    error = state.add_routed_experts(np.zeros((2, 2, 2), np.uint8), PROMPT)
    assert error is not None
    assert error.endswith(f"chunk starts at {PROMPT}, expected {PROMPT + 1}")
