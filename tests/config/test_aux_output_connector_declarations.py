"""Connectors declare their routed-experts support on the class, and the gate reads
only that declaration (patches allow-routed-experts-capture-with-nixlconnector-p-d
and bound-offload-loads-to-positions-without-routed).

The connectors below are out of tree: they are loaded through
`kv_connector_module_path` (this module), the way a plugin's connector is. Each
declaring one is paired with the same connector declaring nothing, which the gate
must refuse: that pair is the negative control for "the gate reads the declaration".
"""

from __future__ import annotations

from typing import Any

import pytest
from aux_gate_utils import _config, _multi, _verify

from tests.fork_base import only_without_upstream_cap
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVTransferKind,
    RoutedExpertsSupport,
)


class _OutOfTreeConnector(KVConnectorBase_V1):
    """Never built: the gate reads class attributes only."""

    def __init__(
        self, vllm_config: Any, role: Any, kv_cache_config: Any = None
    ) -> None:
        raise AssertionError("the startup gate must not build connectors")


class BoundedOffloadConnector(_OutOfTreeConnector):
    kv_transfer_kind = KVTransferKind.KV_OFFLOAD
    routed_experts_support = RoutedExpertsSupport.BOUNDED_LOADS


class UndeclaredOffloadConnector(_OutOfTreeConnector):
    kv_transfer_kind = KVTransferKind.KV_OFFLOAD


class PullTransferConnector(_OutOfTreeConnector):
    kv_transfer_kind = KVTransferKind.PD_TRANSFER
    routed_experts_support = RoutedExpertsSupport.PD_DECODE_LOADS


class PushTransferConnector(_OutOfTreeConnector):
    kv_transfer_kind = KVTransferKind.PD_TRANSFER


def _oot(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_module_path": __name__,
        "kv_connector_extra_config": extra,
    }


def _oot_kv(name: str) -> KVTransferConfig:
    return KVTransferConfig(**_oot(name))


def test_the_factory_reads_an_out_of_tree_class_and_falls_back_to_the_defaults() -> (
    None
):
    assert (
        KVConnectorFactory.declarations_class(_oot_kv("BoundedOffloadConnector"))
        is BoundedOffloadConnector
    )
    unknown = KVTransferConfig(kv_connector="NotRegisteredAnywhere", kv_role="kv_both")
    assert KVConnectorFactory.declarations_class(unknown) is KVConnectorBase_V1
    assert KVConnectorBase_V1.routed_experts_support is RoutedExpertsSupport.UNSUPPORTED
    assert KVConnectorBase_V1.kv_transfer_kind is KVTransferKind.UNKNOWN


@pytest.mark.parametrize("name", ["BoundedOffloadConnector", "PullTransferConnector"])
def test_an_out_of_tree_connector_that_declares_support_is_accepted(name: str) -> None:
    _verify(_config(_oot_kv(name)))
    _verify(
        _config(
            _multi({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, _oot(name))
        )
    )


@only_without_upstream_cap
def test_the_same_connector_without_the_declaration_is_rejected() -> None:
    for kv in (
        _oot_kv("UndeclaredOffloadConnector"),
        _multi(
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            _oot("UndeclaredOffloadConnector"),
        ),
    ):
        with pytest.raises(
            ValueError,
            match="incompatible with UndeclaredOffloadConnector: it "
            "loads KV blocks without their routed-experts rows",
        ):
            _verify(_config(kv))


def test_an_out_of_tree_pd_transport_without_support_gets_the_pd_message() -> None:
    with pytest.raises(
        ValueError,
        match="incompatible with PushTransferConnector; P/D "
        "auxiliary output is supported with NixlConnector, "
        r"NixlPullConnector \(pull mode\) only\.",
    ):
        _verify(_config(_oot_kv("PushTransferConnector")))


def test_in_tree_declarations() -> None:
    """What the in-tree connectors declare (read from the classes themselves)."""

    def declared(name: str) -> tuple[KVTransferKind, RoutedExpertsSupport]:
        cls = KVConnectorFactory.declarations_class(
            KVTransferConfig(kv_connector=name, kv_role="kv_both")
        )
        return cls.kv_transfer_kind, cls.routed_experts_support

    pd, offload = KVTransferKind.PD_TRANSFER, KVTransferKind.KV_OFFLOAD
    assert declared("NixlConnector") == (pd, RoutedExpertsSupport.PD_DECODE_LOADS)
    assert declared("NixlPullConnector") == (pd, RoutedExpertsSupport.PD_DECODE_LOADS)
    assert declared("NixlPushConnector") == (pd, RoutedExpertsSupport.UNSUPPORTED)
    assert declared("MooncakeConnector") == (pd, RoutedExpertsSupport.UNSUPPORTED)
    assert declared("MoRIIOConnector") == (pd, RoutedExpertsSupport.UNSUPPORTED)
    assert declared("OffloadingConnector") == (
        offload,
        RoutedExpertsSupport.BOUNDED_LOADS,
    )
    assert declared("MooncakeStoreConnector") == (
        offload,
        RoutedExpertsSupport.BOUNDED_LOADS,
    )
    assert declared("SimpleCPUOffloadConnector") == (
        offload,
        RoutedExpertsSupport.UNSUPPORTED,
    )
    assert declared("HiSparseConnector") == (
        KVTransferKind.HOST_RESIDENT,
        RoutedExpertsSupport.NO_PREFIX_LOADS,
    )
