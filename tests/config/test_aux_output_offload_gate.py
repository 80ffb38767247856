"""The routed-experts startup gate for connectors that load prefix KV (patches
bound-offload-loads-to-positions-without-routed and
cut-local-prefix-hits-at-kv-blocks-filled-by).

On 0.31: bounded loaders accepted, unbounded ones and hybrid models rejected. On
0.33, upstream caps every external hit at the blocks whose rows it retains, so the
0.33 series drops the gate: every loader is accepted, P/D transports keep their own
gate (test_aux_output_connector_gate.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from aux_gate_utils import _child, _config, _kv, _multi, _verify

from tests.fork_base import only_with_upstream_cap, only_without_upstream_cap

OFFLOAD_SUPPORTED = (
    "supported KV connectors are NixlConnector, NixlPullConnector, "
    "OffloadingConnector, MooncakeStoreConnector, HiSparseConnector"
)


@pytest.mark.parametrize("name", ["OffloadingConnector", "MooncakeStoreConnector"])
def test_bounded_loaders_are_accepted(name: str) -> None:
    _verify(_config(_kv(name)))
    _verify(_config(_multi(_child("NixlConnector"), _child(name))))


def test_a_connector_that_loads_no_prefix_is_accepted_beside_nixl() -> None:
    """HiSparse alone is a colocated HiSparse instance, which the HiSparse row of
    the gate refuses (tests/config/test_hisparse_chain_policy.py)."""
    _verify(_config(_multi(_child("NixlConnector"), _child("HiSparseConnector"))))


UNBOUNDED_LOADERS = [
    "SimpleCPUOffloadConnector",
    "LMCacheConnectorV1",
    "LMCacheMPConnector",
    "FlexKVConnectorV1",
    "HF3FSKVConnector",
    "ExampleConnector",
    "DecodeBenchConnector",
    "MyOwnOffloadConnector",
]


@only_without_upstream_cap
@pytest.mark.parametrize("name", UNBOUNDED_LOADERS)
def test_unbounded_loaders_are_rejected_alone_and_as_children(name: str) -> None:
    for kv in (_kv(name), _multi(_child("NixlConnector"), _child(name))):
        with pytest.raises(ValueError) as err:
            _verify(_config(kv))
        message = str(err.value)
        assert (
            f"incompatible with {name}: it loads KV blocks without their "
            "routed-experts rows" in message
        )
        assert OFFLOAD_SUPPORTED in message


@only_with_upstream_cap
@pytest.mark.parametrize("name", UNBOUNDED_LOADERS)
def test_unbounded_loaders_are_accepted_where_upstream_caps_their_hits(
    name: str,
) -> None:
    """0.33 counterpart of the rejection above: the cap is tested in
    tests/v1/core/test_aux_output_loaded_block_cut.py."""
    for kv in (_kv(name), _multi(_child("NixlConnector"), _child(name))):
        _verify(_config(kv))


@only_without_upstream_cap
@pytest.mark.parametrize("name", ["OffloadingConnector", "MooncakeStoreConnector"])
def test_offload_on_hybrid_models_is_rejected(name: str) -> None:
    hybrid = SimpleNamespace(runner_type="generate", is_moe=True, is_hybrid=True)
    with pytest.raises(ValueError, match=f"with {name} is not supported for hybrid"):
        _verify(
            _config(_multi(_child("NixlConnector"), _child(name)), model_config=hybrid)
        )
    _verify(
        _config(_kv("NixlConnector"), model_config=hybrid)
    )  # P/D alone stays accepted


@only_with_upstream_cap
@pytest.mark.parametrize("name", ["OffloadingConnector", "MooncakeStoreConnector"])
def test_offload_on_hybrid_models_is_accepted_where_the_cap_bounds_the_hit(
    name: str,
) -> None:
    """0.33 counterpart: upstream passes the capped hit length to the hybrid
    reconcile path too, so the cut no longer bypasses it."""
    hybrid = SimpleNamespace(runner_type="generate", is_moe=True, is_hybrid=True)
    _verify(_config(_multi(_child("NixlConnector"), _child(name)), model_config=hybrid))


def test_offload_gate_is_inactive_without_routed_experts() -> None:
    _verify(
        _config(
            _kv("SimpleCPUOffloadConnector"),
            aux_output_config=SimpleNamespace(enabled=False),
        )
    )
