"""`KVTransferConfig.enable_routed_experts_transfer` at startup (patch
`transfer-routed-experts-rows-with-the-kv-over-nixl`): where rows can travel with
the KV, and the NIXL compatibility hash, which covers the rows format only when the
switch is on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.config.aux_gate_utils import NIXL, _config, _kv, _multi, _verify
from vllm.config import KVTransferConfig


def _nixl(**fields: object) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", **fields)


def test_nixl_with_the_switch_is_accepted_on_both_roles() -> None:
    for role in ("kv_producer", "kv_consumer", "kv_both"):
        _verify(
            _config(
                KVTransferConfig(
                    kv_connector="NixlConnector",
                    kv_role=role,
                    enable_routed_experts_transfer=True,
                )
            )
        )


def test_the_switch_defaults_off() -> None:
    assert (
        KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both"
        ).enable_routed_experts_transfer
        is False
    )


def test_the_switch_without_routed_experts_names_the_fix() -> None:
    config = _config(
        _nixl(enable_routed_experts_transfer=True),
        aux_output_config=SimpleNamespace(enabled=False),
    )
    with pytest.raises(ValueError, match="needs --enable-return-routed-experts"):
        _verify(config)
    # Off with routed experts off: nothing to check.
    _verify(_config(_nixl(), aux_output_config=SimpleNamespace(enabled=False)))


def test_the_switch_without_a_connector_that_carries_rows_is_rejected() -> None:
    kv = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        enable_routed_experts_transfer=True,
    )
    with pytest.raises(ValueError, match="this chain has ExampleConnector. Add "):
        _verify(_config(kv))
    # Offload connectors that carry rows accept it from the PR that makes them
    # (test_offload_rows_startup_log.py, test_mooncake_store_rows_startup.py).


def test_a_multiconnector_needs_the_switch_on_itself_and_on_its_nixl_child() -> None:
    flagged_child = {**NIXL, "enable_routed_experts_transfer": True}
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    both = _multi(flagged_child, offload)
    both.enable_routed_experts_transfer = True
    _verify(_config(both))
    with pytest.raises(
        ValueError, match="child NixlConnector but not on the MultiConnector"
    ):
        _verify(_config(_multi(flagged_child, offload)))
    top_only = _multi(NIXL, offload)
    top_only.enable_routed_experts_transfer = True
    with pytest.raises(ValueError, match="not on its child NixlConnector"):
        _verify(_config(top_only))


def test_the_nixl_child_must_come_first() -> None:
    # A child asked before NIXL would look a decode request up before NIXL marks
    # it as one whose rows come with the KV, and load rowless blocks unbounded.
    nixl = {**NIXL, "enable_routed_experts_transfer": True}
    store = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    first = _multi(nixl, store)
    first.enable_routed_experts_transfer = True
    _verify(_config(first))
    second = _multi(store, nixl)
    second.enable_routed_experts_transfer = True
    with pytest.raises(
        ValueError,
        match="needs the P/D connector first in the MultiConnector; this chain has "
        "MooncakeStoreConnector, NixlConnector. Put NixlConnector first",
    ):
        _verify(_config(second))
    # Without the switch the order is the user's, as before.
    _verify(_config(_multi(store, NIXL)))


def test_hybrid_models_are_rejected() -> None:
    model = SimpleNamespace(runner_type="generate", is_moe=True, is_hybrid=True)
    with pytest.raises(ValueError, match="not supported for hybrid"):
        _verify(_config(_nixl(enable_routed_experts_transfer=True), model_config=model))


def test_without_the_switch_nixl_p_d_passes_the_startup_check() -> None:
    """Only the check: what the switch changes on a decode instance (whether its
    pull marks the rows as coming with the KV, so the proxy merge is not needed)
    is asserted with and without it on a real Scheduler in
    tests/v1/core/test_rows_with_kv_decode_loads.py."""
    _verify(_config(_kv("NixlConnector")))


# --- the NIXL compatibility hash ----------------------------------------------------


def _hash_inputs(enabled: bool, num_experts: int = 8) -> SimpleNamespace:
    model = SimpleNamespace(
        model="tiny",
        dtype="float32",
        get_total_num_kv_heads=lambda: 2,
        get_head_size=lambda: 16,
        get_total_num_hidden_layers=lambda: 2,
        get_num_experts_per_tok=lambda: 2,
        get_num_experts=lambda: num_experts,
    )
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=32),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        speculative_config=None,
        kv_transfer_config=_nixl(enable_routed_experts_transfer=enabled),
        aux_output_config=SimpleNamespace(enabled=True),
    )


def test_the_hash_changes_only_with_the_switch_on() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        compute_nixl_compatibility_hash,
    )

    off = compute_nixl_compatibility_hash(_hash_inputs(False), "CPU_ATTN")
    on = compute_nixl_compatibility_hash(_hash_inputs(True), "CPU_ATTN")
    assert off != on
    # With the switch off the factors are upstream's: routed experts do not matter.
    no_aux = _hash_inputs(False)
    no_aux.aux_output_config = SimpleNamespace(enabled=False)
    assert compute_nixl_compatibility_hash(no_aux, "CPU_ATTN") == off
    # Another row dtype (300 experts: uint16) is another format.
    assert compute_nixl_compatibility_hash(_hash_inputs(True, 300), "CPU_ATTN") != on


def test_the_rows_format_describes_layers_top_k_dtype_and_block_size() -> None:
    from vllm.distributed.aux_output_connector.rows_transfer import rows_format

    described = rows_format(_hash_inputs(True, 300))
    assert described is not None
    assert described.describe() == "v1 layers=2 top_k=2 dtype=uint16 block_size=32"
    assert rows_format(_hash_inputs(False)) is None
