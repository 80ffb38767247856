"""vLLM 0.34.0's shape of the routed-experts gate for connectors that may load
prefix KV without rows (patch bound-offload-loads-to-positions-without-routed):
upstream caps every external hit at the blocks whose rows it retains
(tests/v1/core/test_aux_output_retained_rows_cap.py), so such a loader, an
undeclared out-of-tree one and an offload on a hybrid model are accepted at
startup. vLLM 0.31.0 rejects them; its series lists
test_aux_output_unbounded_loaders_rejected.py in place of this file.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.config.aux_gate_utils import (
    UNBOUNDED_LOADERS,
    OutOfTreeConnector,
    _child,
    _config,
    _kv,
    _multi,
    _verify,
    out_of_tree,
)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVTransferKind


class UndeclaredOffloadConnector(OutOfTreeConnector):
    kv_transfer_kind = KVTransferKind.KV_OFFLOAD


@pytest.mark.parametrize("name", UNBOUNDED_LOADERS)
def test_unbounded_loaders_are_accepted_where_upstream_caps_their_hits(
    name: str,
) -> None:
    """The cap itself: tests/v1/core/test_aux_output_retained_rows_cap.py."""
    for kv in (_kv(name), _multi(_child("NixlConnector"), _child(name))):
        _verify(_config(kv))


@pytest.mark.parametrize("name", ["OffloadingConnector", "MooncakeStoreConnector"])
def test_offload_on_hybrid_models_is_accepted_where_the_cap_bounds_the_hit(
    name: str,
) -> None:
    """Upstream passes the capped hit length to the hybrid reconcile path too."""
    hybrid = SimpleNamespace(runner_type="generate", is_moe=True, is_hybrid=True)
    _verify(_config(_multi(_child("NixlConnector"), _child(name)), model_config=hybrid))


def test_an_undeclared_loader_is_left_to_upstreams_cap() -> None:
    _verify(
        _config(KVTransferConfig(**out_of_tree("UndeclaredOffloadConnector", __name__)))
    )
