"""Connectors that load KV declare routed-experts support on the class, and the
gate reads only that declaration (patch
bound-offload-loads-to-positions-without-routed).

The connector below is out of tree, loaded through `kv_connector_module_path`
(this module). The same connector declaring nothing is the negative control for
"the gate reads the declaration": vLLM 0.31.0's gate refuses it
(test_aux_output_unbounded_loaders_rejected.py); on vLLM 0.34.0 upstream's cap
refuses its hits instead and the gate accepts it
(test_aux_output_unbounded_loaders_capped.py).
"""

from __future__ import annotations

from tests.config.aux_gate_utils import (
    NIXL,
    OutOfTreeConnector,
    _config,
    _multi,
    _verify,
    declared,
    out_of_tree,
)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVTransferKind,
    RoutedExpertsSupport,
)


class BoundedOffloadConnector(OutOfTreeConnector):
    kv_transfer_kind = KVTransferKind.KV_OFFLOAD
    routed_experts_support = RoutedExpertsSupport.BOUNDED_LOADS


def test_an_out_of_tree_loader_that_declares_bounded_loads_is_accepted() -> None:
    _verify(
        _config(KVTransferConfig(**out_of_tree("BoundedOffloadConnector", __name__)))
    )
    _verify(_config(_multi(NIXL, out_of_tree("BoundedOffloadConnector", __name__))))


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
