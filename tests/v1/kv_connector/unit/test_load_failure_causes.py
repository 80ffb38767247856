"""Why a load failed reaches the scheduler with the failure (patch
say-why-a-request-failed-when-its-kv-could-not-be): KVConnectorOutput carries
load_failure_causes, and KVOutputAggregator, which joins the outputs of every
worker of a TP group, passes a request's cause on in the step the scheduler
learns the request's failure. A failed receive (failed_recving) is learnt once
every worker finished receiving; a failed block (invalid_block_ids) at once. The
NIXL worker names lease expiry as the cause of the read its lease check failed.
"""

from __future__ import annotations

from copy import copy

from tests.v1.kv_connector.unit.nixl_lease_utils import pair, stub_worker
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


def test_nixl_names_lease_expiry_as_the_cause() -> None:
    """The NIXL worker's lease check (test_nixl_lease_generations.py) fails a read
    whose block was bumped; its cause names the block and both generations, once."""
    producer, consumer = pair()
    worker = stub_worker(consumer)
    assert consumer.record_read("r", "P", 0, [5, 6], [1, 2], {1: 0, 2: 0})
    producer.apply({1: 1})
    for _ in range(2):  # post the word READ, then compare
        worker._check_block_generations({"r"})
    assert worker.get_load_failure_causes() == {
        "r": "the prefill instance released its KV blocks on lease expiry before "
        "they were read (block 1 of engine P rank 0 is at generation 1, the "
        "hand-off's was 0)"
    }
    assert worker.get_load_failure_causes() == {}


def test_nixl_names_no_cause_for_a_read_that_passed() -> None:
    """Negative control: the same read without the bump fails nothing."""
    _, consumer = pair()
    worker = stub_worker(consumer)
    assert consumer.record_read("r", "P", 0, [5, 6], [1, 2], {1: 0, 2: 0})
    for _ in range(2):
        worker._check_block_generations({"r"})
    assert worker._recv_failures == set()
    assert worker.get_load_failure_causes() == {}
