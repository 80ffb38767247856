"""The routed-experts startup of the Mooncake store (patch
store-routed-experts-rows-beside-mooncake-store): rows objects are stored beside
its chunks, so enable_routed_experts_transfer is accepted on it, and without the
switch it says what that costs, as the native offload does
(test_offload_rows_startup_log.py).
"""

from __future__ import annotations

import pytest

from tests.config.aux_gate_utils import _config, _kv, _verify
from tests.config.offload_rows_log_utils import offload_cost_warning, policy_warnings
from vllm.config import KVTransferConfig


def test_the_switch_is_accepted_on_the_store() -> None:
    with policy_warnings() as records:
        _verify(
            _config(
                KVTransferConfig(
                    kv_connector="MooncakeStoreConnector",
                    kv_role="kv_both",
                    enable_routed_experts_transfer=True,
                )
            )
        )
    assert records.messages == []


def test_the_store_without_the_switch_says_what_it_costs() -> None:
    with policy_warnings() as records:
        _verify(_config(_kv("MooncakeStoreConnector")))
    assert records.messages == [offload_cost_warning("MooncakeStoreConnector")]


def test_another_connector_with_the_switch_is_still_refused() -> None:
    """Negative control: the switch on a connector that stores no rows."""
    kv = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        enable_routed_experts_transfer=True,
    )
    with pytest.raises(ValueError, match="this chain has ExampleConnector"):
        _verify(_config(kv))
