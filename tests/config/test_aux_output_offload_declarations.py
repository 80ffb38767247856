"""Connectors that load KV declare routed-experts support on the class, and the
gate reads only that declaration (patch
bound-offload-loads-to-positions-without-routed).

The connectors below are out of tree, loaded through `kv_connector_module_path`
(this module). The offload connector that declares bounded loads is paired with
the same connector declaring nothing, which the 0.31.0 gate must refuse: the
negative control for "the gate reads the declaration". On 0.33.0 upstream's cap
refuses an undeclared connector's hits instead, so the gate accepts it.
"""

from __future__ import annotations

import pytest
from aux_gate_utils import (
    NIXL,
    OutOfTreeConnector,
    _config,
    _multi,
    _verify,
    declared,
    out_of_tree,
)

from tests.fork_base import only_with_upstream_cap, only_without_upstream_cap
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVTransferKind,
    RoutedExpertsSupport,
)


class BoundedOffloadConnector(OutOfTreeConnector):
    kv_transfer_kind = KVTransferKind.KV_OFFLOAD
    routed_experts_support = RoutedExpertsSupport.BOUNDED_LOADS


class UndeclaredOffloadConnector(OutOfTreeConnector):
    kv_transfer_kind = KVTransferKind.KV_OFFLOAD


def test_an_out_of_tree_loader_that_declares_bounded_loads_is_accepted() -> None:
    _verify(
        _config(KVTransferConfig(**out_of_tree("BoundedOffloadConnector", __name__)))
    )
    _verify(_config(_multi(NIXL, out_of_tree("BoundedOffloadConnector", __name__))))


@only_without_upstream_cap
def test_the_same_loader_without_the_declaration_is_rejected() -> None:
    for kv in (
        KVTransferConfig(**out_of_tree("UndeclaredOffloadConnector", __name__)),
        _multi(NIXL, out_of_tree("UndeclaredOffloadConnector", __name__)),
    ):
        with pytest.raises(
            ValueError,
            match="incompatible with UndeclaredOffloadConnector: it loads KV blocks "
            "without their routed-experts rows",
        ):
            _verify(_config(kv))


@only_with_upstream_cap
def test_on_033_the_undeclared_loader_is_left_to_upstreams_cap() -> None:
    _verify(
        _config(KVTransferConfig(**out_of_tree("UndeclaredOffloadConnector", __name__)))
    )


def test_in_tree_loading_declarations() -> None:
    offload = KVTransferKind.KV_OFFLOAD
    bounded = RoutedExpertsSupport.BOUNDED_LOADS
    assert declared("OffloadingConnector") == (offload, bounded)
    assert declared("MooncakeStoreConnector") == (offload, bounded)
    assert declared("HiSparseConnector") == (
        KVTransferKind.HOST_RESIDENT,
        RoutedExpertsSupport.NO_PREFIX_LOADS,
    )
    for name in (
        "SimpleCPUOffloadConnector",
        "ExampleConnector",
        "DecodeBenchConnector",
    ):
        assert declared(name)[1] == RoutedExpertsSupport.UNSUPPORTED
