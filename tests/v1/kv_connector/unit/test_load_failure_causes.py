"""Why a load failed reaches the scheduler with the failure (patch
say-why-a-request-failed-when-its-kv-could-not-be): KVConnectorOutput carries
load_failure_causes, and KVOutputAggregator, which joins the outputs of every
worker of a TP group, passes a request's cause on in the step the scheduler
learns the request's failure. A failed receive (failed_recving) is learnt once
every worker finished receiving; a failed block (invalid_block_ids) at once.
"""

from __future__ import annotations

from copy import copy

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    KVConnectorOutput,
    ModelRunnerOutput,
)

READ_FAILED = "the NIXL READ of its KV failed"
ROWS_FAILED = "the routed-experts rows sent with its KV failed their check"


def worker_output(**fields) -> ModelRunnerOutput:
    """One worker's output of a step (its own object: the aggregator writes the
    joined result into the output rank's)."""
    output = copy(EMPTY_MODEL_RUNNER_OUTPUT)
    output.kv_connector_output = KVConnectorOutput(**fields) if fields else None
    return output


def joined(aggregator: KVOutputAggregator, *outputs: ModelRunnerOutput):
    output = aggregator.aggregate(list(outputs))
    assert output is not None and output.kv_connector_output is not None
    return output.kv_connector_output


def test_a_cause_alone_is_not_an_empty_output() -> None:
    assert not KVConnectorOutput(load_failure_causes={"r": READ_FAILED}).is_empty()


def test_a_failed_receive_keeps_its_cause_until_every_worker_finished() -> None:
    aggregator = KVOutputAggregator(expected_finished_count=2)
    first = joined(
        aggregator,
        worker_output(
            finished_recving={"r"},
            failed_recving={"r"},
            load_failure_causes={"r": READ_FAILED},
        ),
        worker_output(),
    )
    # Worker 1 still receives: neither the failure nor its cause is learnt yet.
    assert (first.failed_recving, first.load_failure_causes) == (set(), {})
    second = joined(aggregator, worker_output(), worker_output(finished_recving={"r"}))
    assert second.failed_recving == {"r"}
    assert second.load_failure_causes == {"r": READ_FAILED}
    third = joined(aggregator, worker_output(), worker_output())
    assert third.load_failure_causes == {}  # passed on once


def test_a_failed_block_passes_its_cause_on_at_once() -> None:
    aggregator = KVOutputAggregator(expected_finished_count=2)
    output = joined(
        aggregator,
        worker_output(invalid_block_ids={7}, load_failure_causes={"r": ROWS_FAILED}),
        worker_output(),
    )
    assert output.invalid_block_ids == {7}
    assert output.load_failure_causes == {"r": ROWS_FAILED}


def test_the_first_worker_cause_of_a_request_wins() -> None:
    aggregator = KVOutputAggregator(expected_finished_count=2)
    output = joined(
        aggregator,
        worker_output(invalid_block_ids={7}, load_failure_causes={"r": ROWS_FAILED}),
        worker_output(invalid_block_ids={7}, load_failure_causes={"r": READ_FAILED}),
    )
    assert output.load_failure_causes == {"r": ROWS_FAILED}
