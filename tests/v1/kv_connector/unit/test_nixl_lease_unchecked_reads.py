"""KV reads decode cannot check against lease expiry are counted and logged once per
cause (patch `fail-closed-when-decode-reads-blocks-released-on`).

The check needs the producer's block generations and a read whose blocks map one to
one. Region-mapped reads, a block size ratio other than 1, a producer that sends no
generations or advertises no words, and parameters missing a block's generation are
not checked. Each such read adds one to the NIXL stats' `num_lease_unchecked_reads`
(Prometheus `vllm:nixl_num_lease_unchecked_reads`), and each cause is logged once per
remote engine, not once per request.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

from tests.v1.kv_connector.unit.nixl_lease_utils import pair
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
)


def worker(generations: dict[int, int] | None) -> NixlPullConnectorWorker:
    """The pull worker's lease-check entry point around a real
    NixlBlockGenerations; request "r" pulls remote blocks 1, 2."""
    w = object.__new__(NixlPullConnectorWorker)
    w._producer, w._block_generations = pair()  # the producer keeps its words
    w.xfer_stats = NixlKVConnectorStats()
    w._recving_metadata = {
        "r": SimpleNamespace(remote=SimpleNamespace(block_generations=generations))
    }
    w.transfer_topo = MagicMock()
    w.transfer_topo.get_engine_info.return_value = SimpleNamespace(
        remote_physical_blocks_per_logical=1
    )
    w._physical_blocks_per_logical_kv_block = 1
    return w


def read(w: NixlPullConnectorWorker, *, by_region=False, ratio=1) -> bool:
    spec = SimpleNamespace(block_ids_by_region=by_region, remote_rank=0)
    return w._record_generation_read(spec, "r", "P", ratio, [[3, 4]], [[1, 2]])


CASES = {
    "region-mapped": (dict(by_region=True), {1: 0, 2: 0}),
    "block size ratio": (dict(ratio=2), {1: 0, 2: 0}),
    "no generations": ({}, None),
    "a block without a generation": ({}, {1: 0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_unchecked_read_is_counted_and_its_cause_logged_once(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    kwargs, generations = CASES[case]
    w = worker(generations)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert read(w, **kwargs) is False
    assert w.xfer_stats.data["num_lease_unchecked_reads"] == [1, 1, 1]
    logged = [
        r.getMessage() for r in caplog.records if "lease expiry" in r.getMessage()
    ]
    assert len(logged) == 1, logged
    assert "engine P" in logged[0]


def test_a_checked_read_is_not_counted() -> None:
    """Negative control: generations for every block, one-to-one blocks."""
    w = worker({1: 0, 2: 0})
    assert read(w) is True
    assert w.xfer_stats.data["num_lease_unchecked_reads"] == []


def test_the_count_reaches_prometheus() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
        NixlPromMetrics,
    )

    stats = NixlKVConnectorStats()
    stats.record_lease_unchecked_read()
    stats.record_lease_unchecked_read()
    assert not stats.is_empty()
    counters: dict[str, MagicMock] = {}

    def counter(name: str, **_: object) -> MagicMock:
        return counters.setdefault(name, MagicMock())

    from prometheus_client import Counter, Gauge, Histogram

    metrics = NixlPromMetrics(
        MagicMock(),
        {Counter: counter, Gauge: MagicMock(), Histogram: MagicMock()},
        ["model"],
        {0: ["m"]},
    )
    metrics.observe(stats.data, 0)
    child = counters["vllm:nixl_num_lease_unchecked_reads"].labels.return_value
    assert [c.args for c in child.inc.call_args_list] == [(1,), (1,)]
