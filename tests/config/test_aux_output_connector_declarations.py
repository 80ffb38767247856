"""Connectors declare their routed-experts support on the class, and the P/D gate
reads only that declaration (patch allow-routed-experts-capture-with-nixlconnector-p-d;
the offload rows are in test_aux_output_offload_declarations.py).

The connectors below are out of tree: they are loaded through
`kv_connector_module_path` (this module), the way a plugin's connector is. The P/D
transport that declares support is paired with the same transport declaring
nothing, which the gate must refuse: that pair is the negative control for "the
gate reads the declaration".
"""

from __future__ import annotations

import pytest

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
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVTransferKind,
    RoutedExpertsSupport,
)


class PullTransferConnector(OutOfTreeConnector):
    kv_transfer_kind = KVTransferKind.PD_TRANSFER
    routed_experts_support = RoutedExpertsSupport.PD_DECODE_LOADS


class PushTransferConnector(OutOfTreeConnector):
    kv_transfer_kind = KVTransferKind.PD_TRANSFER


def test_the_factory_reads_an_out_of_tree_class_or_the_defaults() -> None:
    config = KVTransferConfig(**out_of_tree("PullTransferConnector", __name__))
    assert KVConnectorFactory.declarations_class(config) is PullTransferConnector
    unknown = KVTransferConfig(kv_connector="NotRegisteredAnywhere", kv_role="kv_both")
    assert KVConnectorFactory.declarations_class(unknown) is KVConnectorBase_V1
    assert KVConnectorBase_V1.routed_experts_support is RoutedExpertsSupport.UNSUPPORTED
    assert KVConnectorBase_V1.kv_transfer_kind is KVTransferKind.UNKNOWN


def test_an_out_of_tree_pd_transport_that_declares_support_is_accepted() -> None:
    _verify(_config(KVTransferConfig(**out_of_tree("PullTransferConnector", __name__))))
    _verify(_config(_multi(out_of_tree("PullTransferConnector", __name__))))


def test_the_same_transport_without_the_declaration_is_rejected() -> None:
    for kv in (
        KVTransferConfig(**out_of_tree("PushTransferConnector", __name__)),
        _multi(NIXL, out_of_tree("PushTransferConnector", __name__)),
    ):
        with pytest.raises(
            ValueError,
            match="incompatible with PushTransferConnector; P/D auxiliary output is "
            r"supported with NixlConnector, NixlPullConnector \(pull mode\) only\.",
        ):
            _verify(_config(kv))


def test_in_tree_pd_declarations() -> None:
    pd = KVTransferKind.PD_TRANSFER
    assert declared("NixlConnector") == (pd, RoutedExpertsSupport.PD_DECODE_LOADS)
    assert declared("NixlPullConnector") == (pd, RoutedExpertsSupport.PD_DECODE_LOADS)
    assert declared("NixlPushConnector") == (pd, RoutedExpertsSupport.UNSUPPORTED)
    assert declared("MooncakeConnector") == (pd, RoutedExpertsSupport.UNSUPPORTED)
    assert declared("MoRIIOConnector") == (pd, RoutedExpertsSupport.UNSUPPORTED)
