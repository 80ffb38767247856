"""The startup log of a routed-experts server whose KV offload connector could carry
the rows but runs without enable_routed_experts_transfer (patch
carry-routed-experts-rows-with-offloaded-kv-chunks): it says what that costs and
the one setting that lifts it (not for hybrid models, which cannot take it), once
per connector, and says nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tests.config.aux_gate_utils import (
    LogRecords,
    _child,
    _config,
    _kv,
    _multi,
    _verify,
)
from tests.config.offload_rows_log_utils import offload_cost_warning, policy_warnings
from vllm.config import KVTransferConfig


@pytest.fixture
def records() -> Iterator[LogRecords]:
    with policy_warnings() as handler:
        yield handler


def _with_switch(name: str) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=name,
        kv_role="kv_both",
        enable_routed_experts_transfer=True,
    )


def test_an_offload_without_the_switch_says_what_it_costs(
    records: LogRecords,
) -> None:
    _verify(_config(_kv("OffloadingConnector")))
    assert records.messages == [offload_cost_warning("OffloadingConnector")]


def test_an_offload_child_beside_nixl_is_named(records: LogRecords) -> None:
    _verify(_config(_multi(_child("NixlConnector"), _child("OffloadingConnector"))))
    assert records.messages == [offload_cost_warning("OffloadingConnector")]


def test_nothing_is_said_with_the_switch(records: LogRecords) -> None:
    _verify(_config(_with_switch("OffloadingConnector")))
    assert records.messages == []


def test_nothing_is_said_without_routed_experts(records: LogRecords) -> None:
    _verify(
        _config(
            _kv("OffloadingConnector"), aux_output_config=SimpleNamespace(enabled=False)
        )
    )
    assert records.messages == []


def test_nothing_is_said_for_a_connector_that_carries_no_rows(
    records: LogRecords,
) -> None:
    """NIXL carries rows but is a P/D transport, not an offload: its switch is
    another question (a one-sided setting fails the handshake)."""
    _verify(_config(_kv("NixlConnector")))
    assert records.messages == []
