"""The scheduler fails one request whose routed-experts rows the worker could not
read, and serves the others (patch
`fail-one-request-when-its-routed-experts-rows-are`).

On a real Scheduler: the worker's output for one request carries an error instead
of rows. That request finishes with an error (EngineCoreOutput.error) whose
message names the positions and the cause (the API server raises it in the
request's stream, tests/v1/entrypoints/test_routed_experts_unavailable_message.py);
a request of the same steps with
rows, and a request that asked for no rows, go on. A request that would have
stopped by length in that very step fails too: it must not finish without its last
rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.v1.aux_scheduler_utils import make_request, make_scheduler, runner_output
from vllm.config import KVTransferConfig
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput
from vllm.v1.engine import FinishReason

pytestmark = pytest.mark.usefixtures("scheduler_env")

ERROR = "routed-experts rows of positions [0, 20) could not be read (planted)"
MESSAGE = (
    "This request was stopped rather than answered with incomplete routed-experts "
    "rows: its routed-experts rows of positions [0, 20) could not be read "
    "(planted). Retry the request, or set return_routed_experts to false if it "
    "does not need them."
)


def run(scheduler, broken: set[str], steps: int) -> dict[str, list[Any]]:
    """`steps` schedule + update rounds; the worker cannot read the rows of the
    requests in `broken` from the first step on. Returns each request's outputs."""
    seen: dict[str, list[Any]] = {}
    for _ in range(steps):
        out = scheduler.schedule()
        output = runner_output(scheduler, out)
        for rid in broken & set(output.aux_output_connector_output):
            start = output.aux_output_connector_output[rid].token_start
            output.aux_output_connector_output[rid] = AuxRequestOutput(
                start, np.empty((0, 2, 2), np.uint8), error=ERROR
            )
        engine = scheduler.update_from_output(out, output)
        for outputs in engine.values():
            for o in outputs.outputs:
                seen.setdefault(o.request_id, []).append(o)
    return seen


def nixl_scheduler(model_dir: Path):
    return make_scheduler(
        model_dir, KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    )


def test_the_request_without_rows_fails_and_the_others_go_on(model_dir: Path) -> None:
    scheduler = nixl_scheduler(model_dir)
    for rid in ("broken", "fine", "opted_out"):
        scheduler.add_request(make_request(rid, list(range(4, 24)), max_tokens=3))
    scheduler.requests["opted_out"].sampling_params.return_routed_experts = False
    seen = run(scheduler, {"broken", "opted_out"}, steps=3)

    [failed] = seen["broken"]
    assert failed.finish_reason == FinishReason.ERROR
    assert failed.error is not None
    assert (failed.error.code, failed.error.message) == (
        "routed_experts_unavailable",
        MESSAGE,
    )
    assert failed.stop_reason is None
    assert failed.routed_experts is None
    assert "broken" not in scheduler.requests

    # The request with rows gets all of them: from 0 to P + C - 1 = 22.
    assert [o.finish_reason for o in seen["fine"]][-1] == FinishReason.LENGTH
    assert sum(len(o.routed_experts) for o in seen["fine"]) == 22
    # The one that asked for no rows never fails for them.
    assert [o.finish_reason for o in seen["opted_out"]][-1] == FinishReason.LENGTH
    assert all(o.routed_experts is None for o in seen["opted_out"])


def test_a_request_that_stops_by_length_in_that_step_fails_too(
    model_dir: Path,
) -> None:
    scheduler = nixl_scheduler(model_dir)
    scheduler.add_request(make_request("last", list(range(4, 24)), max_tokens=1))
    [only] = run(scheduler, {"last"}, steps=1)["last"]
    assert only.finish_reason == FinishReason.ERROR
    assert only.error is not None and only.error.message == MESSAGE


def test_without_the_error_nothing_fails(model_dir: Path) -> None:
    """Negative control: the same requests, every worker output with its rows."""
    scheduler = nixl_scheduler(model_dir)
    scheduler.add_request(make_request("last", list(range(4, 24)), max_tokens=1))
    [only] = run(scheduler, set(), steps=1)["last"]
    assert only.finish_reason == FinishReason.LENGTH
    assert only.error is None
    assert len(only.routed_experts) == 20


def next_request_scheduled_tokens(model_dir: Path, broken: set[str], opted_out: bool):
    """A request runs 3 steps (its rows unavailable when it is in `broken`),
    then a request with the same 20-token prompt that needs rows from 0 is
    scheduled: how many tokens it computes (the rest is its prefix hit)."""
    scheduler = nixl_scheduler(model_dir)
    scheduler.add_request(make_request("first", list(range(4, 24)), max_tokens=3))
    if opted_out:
        scheduler.requests["first"].sampling_params.return_routed_experts = False
    run(scheduler, broken, steps=3)
    assert "first" not in scheduler.requests
    scheduler.add_request(make_request("next", list(range(4, 24)), max_tokens=1))
    return scheduler.schedule().num_scheduled_tokens["next"]


@pytest.mark.parametrize("opted_out", [False, True])
def test_the_blocks_of_a_request_without_rows_are_recomputed_later(
    model_dir: Path, opted_out: bool
) -> None:
    """Its cached blocks may have no rows (its rows could not be captured or
    read): a later request's hit stops before them, so the later request gets
    its rows instead of failing on theirs. Before, the hit was used and the
    later request failed when its rows were read (a request that opted out
    ran on, and its blocks failed the requests after it)."""
    assert next_request_scheduled_tokens(model_dir, {"first"}, opted_out) == 20


def test_the_blocks_of_a_request_with_rows_are_a_hit(model_dir: Path) -> None:
    """Control: the same requests, every worker output with its rows: the later
    request computes only what follows the cached 16-token block."""
    assert next_request_scheduled_tokens(model_dir, set(), opted_out=False) == 4
