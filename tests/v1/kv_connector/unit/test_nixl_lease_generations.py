"""Lease generations (nixl/block_generations.py) on real host memory.

The NIXL agent is a stand-in whose READs copy registered host memory with
`ctypes.memmove`, so the producer's words, the consumer's landing slots and the
comparison run exactly as over a real transport. Expected values are derived by
hand from the contract in the module docstring: a block's generation starts at 0
and goes up by one each time a lease holding it expires and the block is freed.
"""

from __future__ import annotations

import pytest

from tests.v1.kv_connector.unit.nixl_lease_utils import pair, stub_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.block_generations import (
    PARAMS_KEY,
    UNMATCHABLE_GENERATION,
    LeaseGenerations,
    NixlBlockGenerations,
    NixlWorkerMetadata,
    checked_generations,
    expected_generations,
    logical_block_ids,
)


def check(consumer: NixlBlockGenerations, expected: dict[int, int]) -> str | None:
    assert consumer.record_read("r", "P", 0, [5, 6], [1, 2], expected)
    handles: list[int] = []
    consumer.post_reads("r", handles)
    assert len(handles) == 1 and consumer.has_posted("r")
    return consumer.finish("r")


# NIXL takes a word list as one (addr, len, dev) row per word or as one strided
# (addr, len, dev, stride, count) row; descriptor i is word i in both.
@pytest.mark.parametrize("strided_descs", [False, True])
def test_unchanged_words_pass(strided_descs: bool) -> None:
    _, consumer = pair(strided_descs=strided_descs)
    assert check(consumer, {1: 0, 2: 0}) is None
    # The landing slots hold what the producer's words hold.
    assert consumer._landing[0][0][[5, 6]].tolist() == [0, 0]


@pytest.mark.parametrize("strided_descs", [False, True])
def test_a_bumped_block_fails_with_both_generations_named(strided_descs: bool) -> None:
    producer, consumer = pair(strided_descs=strided_descs)
    producer.apply({2: 1, 7: 3})
    assert producer.words.tolist() == [0, 0, 1, 0, 0, 0, 0, 3]
    assert check(consumer, {1: 0, 2: 0}) == (
        "block 2 of engine P rank 0 is at generation 1, the hand-off's was 0"
    )


def test_a_read_that_lands_nothing_fails_closed() -> None:
    """The landing slots are poisoned before the READ: a READ that reports DONE
    but wrote nothing can never pass."""
    _, consumer = pair(lands=False)
    assert check(consumer, {1: 0, 2: 0}) is not None


def test_a_later_handoff_carries_the_bumped_generation() -> None:
    producer, consumer = pair()
    producer.apply({1: 1, 2: 1})
    assert check(consumer, {1: 1, 2: 1}) is None


def test_reads_that_cannot_be_checked_are_not_deferred() -> None:
    _, consumer = pair()
    assert not consumer.record_read("a", "unknown-engine", 0, [1], [1], {1: 0})
    assert not consumer.record_read("b", "P", 0, [1], [1], None)
    assert not consumer.record_read("c", "P", 0, [1, 2], [1, 3], {1: 0})
    assert not consumer.has_posted("a")
    handles: list[int] = []
    consumer.post_reads("b", handles)
    assert handles == []


def test_shutdown_releases_everything() -> None:
    producer, consumer = pair()
    nixl = producer._nixl
    consumer.shutdown()
    producer.shutdown()
    assert nixl.registered == [] and nixl.dlists == {}


def test_scheduler_table_bumps_only_expired_leases() -> None:
    table = LeaseGenerations()
    assert table.lease("a", [[3, 4]]) == [[0, 0]]
    assert table.lease("b", [[4, 5]]) == [[0, 0]]
    table.update(None, {"b"})  # b finished normally: nothing changes
    assert table.take_updates() == {}
    # a's lease expired on one worker; its finish arrives in a later step.
    table.update(NixlWorkerMetadata({"a"}), set())
    assert table.take_updates() == {}
    table.update(None, {"a"})
    assert table.take_updates() == {3: 1, 4: 1}
    assert table.take_updates() == {}
    assert table.lease("c", [[4, 5, 3]]) == [[1, 0, 1]]
    table.update(NixlWorkerMetadata({"c"}), {"c"})
    assert table.take_updates() == {4: 2, 5: 1, 3: 2}


def test_worker_metadata_aggregates_as_a_union() -> None:
    merged = NixlWorkerMetadata({"a"}).aggregate(NixlWorkerMetadata({"b", "a"}))
    assert isinstance(merged, NixlWorkerMetadata)
    assert merged.expired_send_req_ids == {"a", "b"}


def test_worker_reports_reaped_leases_once() -> None:
    producer, _ = pair()
    assert producer.take_worker_meta() is None
    producer.expired_send_req_ids.add("x")
    meta = producer.take_worker_meta()
    assert meta is not None and meta.expired_send_req_ids == {"x"}
    assert producer.take_worker_meta() is None


def test_expected_generations_from_params() -> None:
    params = {"remote_block_ids": [[7, 8], [9]], PARAMS_KEY: [[0, 2], [1]]}
    assert expected_generations(params) == {7: 0, 8: 2, 9: 1}
    assert expected_generations({"remote_block_ids": [[7]]}) is None
    with pytest.raises(ValueError, match=rf"kv_transfer_params.{PARAMS_KEY} .*\[2\]"):
        expected_generations({"remote_block_ids": [[7, 8]], PARAMS_KEY: [[0]]})


@pytest.mark.parametrize(
    "generations",
    [
        [[0, True]],  # a bool is not a generation
        [[0, 1.5]],
        [[0, -1]],
        [[0, {"gen": 1}]],
        [[0, "1"]],
    ],
)
def test_generations_that_are_not_counts_are_refused(generations: list) -> None:
    params = {"remote_block_ids": [[7, 8]], PARAMS_KEY: generations}
    with pytest.raises(ValueError, match=rf"kv_transfer_params.{PARAMS_KEY} "):
        expected_generations(params)


def test_malformed_generations_fail_the_read_instead_of_skipping_it() -> None:
    """Present but malformed: every block expects a generation no word holds, so
    the read is checked and fails (before, it was read unchecked). Absent: the
    read is not checked, as from a producer that sends none."""
    params = {"remote_block_ids": [[1, 2]], PARAMS_KEY: [[0, "zero"]]}
    expected = checked_generations("r", params)
    assert expected == {1: UNMATCHABLE_GENERATION, 2: UNMATCHABLE_GENERATION}
    _, consumer = pair()
    assert check(consumer, expected) == (
        "block 1 of engine P rank 0 is at generation 0, the hand-off's was -1"
    )
    assert checked_generations("r", {"remote_block_ids": [[1, 2]]}) is None
    well_formed = {"remote_block_ids": [[1, 2]], PARAMS_KEY: [[0, 0]]}
    assert checked_generations("r", well_formed) == {1: 0, 2: 0}


def test_logical_block_ids_from_kernel_ids() -> None:
    assert logical_block_ids([[4, 5, 6, 7]], 2) == [2, 3]
    assert logical_block_ids([[3], [1, 2]], 1) == [3, 1, 2]


@pytest.mark.parametrize("bumped", [False, True])
def test_worker_holds_a_request_back_until_its_words_are_compared(bumped: bool) -> None:
    producer, consumer = pair()
    worker = stub_worker(consumer)
    assert consumer.record_read("r", "P", 0, [5, 6], [1, 2], {1: 0, 2: 0})
    if bumped:  # the lease expired and the block was freed before the word READ
        producer.apply({1: 1})
    done = {"r", "other"}
    worker._check_block_generations(done)
    # The KV READ is done: the word READ is posted and r is not reported yet.
    assert done == {"other"}
    assert len(worker._recving_transfers["r"]) == 1
    done = {"r"}
    worker._check_block_generations(done)
    assert done == {"r"}
    assert worker._recv_failures == ({"r"} if bumped else set())
    assert worker.xfer_stats.record_failed_transfer.call_count == int(bumped)


def test_worker_forgets_the_check_of_a_failed_read() -> None:
    _, consumer = pair()
    worker = stub_worker(consumer)
    assert consumer.record_read("r", "P", 0, [5], [1], {1: 0})
    worker._recv_failures.add("r")
    done = {"r"}
    worker._check_block_generations(done)
    assert done == {"r"} and not consumer.has_posted("r") and "r" not in consumer._reads


def assert_a_bumped_block_fails_the_read(
    producer: NixlBlockGenerations, consumer: NixlBlockGenerations
) -> None:
    """The worker path of the lease check: a block bumped between the hand-off
    and the word READ fails the request's load."""
    worker = stub_worker(consumer)
    assert consumer.record_read("r", "P", 0, [5, 6], [1, 2], {1: 0, 2: 0})
    producer.apply({1: 1})
    for _ in range(2):  # post the word READ, then compare
        worker._check_block_generations({"r"})
    assert worker._recv_failures == {"r"}
    assert worker.xfer_stats.record_failed_transfer.call_count == 1


def test_planted_fault_words_never_compared_is_caught() -> None:
    """Negative control: the fault `--fault no-lease-check` plants end to end (decode
    never compares the words: its finish only forgets the check) makes the check
    above fail; the real consumer passes it."""
    assert_a_bumped_block_fails_the_read(*pair())
    producer, consumer = pair()
    consumer.finish = consumer.forget  # type: ignore[assignment,method-assign]
    with pytest.raises(AssertionError):
        assert_a_bumped_block_fails_the_read(producer, consumer)
