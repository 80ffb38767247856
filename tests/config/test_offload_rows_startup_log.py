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
from aux_gate_utils import LogRecords, _child, _config, _kv, _multi, _verify

from tests.fork_base import only_with_store_rows
from vllm import logger as vllm_logger
from vllm.config import KVTransferConfig
from vllm.distributed.aux_output_connector import rows_transfer_policy


@pytest.fixture
def records() -> Iterator[LogRecords]:
    # warning_once remembers what it printed for the whole process.
    vllm_logger._print_warning_once.cache_clear()
    handler = LogRecords()
    rows_transfer_policy.logger.addHandler(handler)
    try:
        yield handler
    finally:
        rows_transfer_policy.logger.removeHandler(handler)


def _cost(name: str) -> str:
    return (
        f"{name} runs without enable_routed_experts_transfer: its chunks carry no "
        "routed-experts rows, so its loads stop at the KV block holding a request's "
        "routed_experts_prompt_start (a request that asks for rows from position 0 "
        'gets no hits from it). Set "enable_routed_experts_transfer": true in its '
        "kv_transfer_config (and on the MultiConnector's) to store the rows with "
        "the chunks (not for hybrid attention + Mamba models, which keep bounded "
        "loads)."
    )


def _with_switch(name: str) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=name,
        kv_role="kv_both",
        enable_routed_experts_transfer=True,
    )


@pytest.mark.parametrize(
    "name",
    [
        "OffloadingConnector",
        # It carries rows from the Mooncake store rows patch on.
        pytest.param("MooncakeStoreConnector", marks=only_with_store_rows),
    ],
)
def test_an_offload_without_the_switch_says_what_it_costs(
    records: LogRecords, name: str
) -> None:
    _verify(_config(_kv(name)))
    assert records.messages == [_cost(name)]


def test_an_offload_child_beside_nixl_is_named(records: LogRecords) -> None:
    _verify(_config(_multi(_child("NixlConnector"), _child("OffloadingConnector"))))
    assert records.messages == [_cost("OffloadingConnector")]


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
