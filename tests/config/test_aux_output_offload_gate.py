"""The routed-experts startup gate for connectors that load prefix KV (patches
bound-offload-loads-to-positions-without-routed and
cut-local-prefix-hits-at-kv-blocks-filled-by).

Bounded loaders are accepted on every base. What happens to the others differs by
base: vLLM 0.31.0 rejects unbounded loaders and offload on hybrid models at startup
(test_aux_output_unbounded_loaders_rejected.py); vLLM 0.34.0 caps every external
hit at the blocks whose rows it retains, so its series accepts them
(test_aux_output_unbounded_loaders_capped.py). P/D transports keep their own gate
(test_aux_output_connector_gate.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.config.aux_gate_utils import _child, _config, _kv, _multi, _verify


@pytest.mark.parametrize("name", ["OffloadingConnector", "MooncakeStoreConnector"])
def test_bounded_loaders_are_accepted(name: str) -> None:
    _verify(_config(_kv(name)))
    _verify(_config(_multi(_child("NixlConnector"), _child(name))))


def test_a_connector_that_loads_no_prefix_is_accepted_beside_nixl() -> None:
    """HiSparse alone is a colocated HiSparse instance, which the HiSparse row of
    the gate refuses (tests/config/test_hisparse_chain_policy.py)."""
    _verify(_config(_multi(_child("NixlConnector"), _child("HiSparseConnector"))))


def test_offload_gate_is_inactive_without_routed_experts() -> None:
    _verify(
        _config(
            _kv("SimpleCPUOffloadConnector"),
            aux_output_config=SimpleNamespace(enabled=False),
        )
    )
