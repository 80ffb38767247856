"""Helpers for the routed-experts startup gate tests:
`VllmConfig._verify_aux_output_compatibility` called unbound on a namespace that
carries only what it reads, plus a real `KVTransferConfig`; and out-of-tree
connector stand-ins loaded by module path, for the tests of the connectors'
declarations."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVTransferKind,
    RoutedExpertsSupport,
)


def _config(kv: KVTransferConfig | None = None, **overrides: Any) -> SimpleNamespace:
    values: dict[str, Any] = dict(
        aux_output_config=SimpleNamespace(enabled=True),
        use_v2_model_runner=True,
        model_config=SimpleNamespace(
            runner_type="generate", is_moe=True, is_hybrid=False
        ),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        speculative_config=None,
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        kv_transfer_config=kv,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def _verify(config: SimpleNamespace) -> None:
    VllmConfig._verify_aux_output_compatibility(config)


def _kv(name: str, role: str = "kv_both", **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=name, kv_role=role, kv_connector_extra_config=extra
    )


def _multi(*children: dict[str, Any]) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": list(children)},
    )


def _child(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


class OutOfTreeConnector(KVConnectorBase_V1):
    """Never built: the gate reads class attributes only."""

    def __init__(
        self, vllm_config: Any, role: Any, kv_cache_config: Any = None
    ) -> None:
        raise AssertionError("the startup gate must not build connectors")


def out_of_tree(name: str, module: str) -> dict[str, Any]:
    """A connector config loaded by module path, as a plugin's is."""
    return {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_module_path": module,
    }


NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
# In-tree connectors that may load prefix KV without its routed-experts rows.
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


def declared(name: str) -> tuple[KVTransferKind, RoutedExpertsSupport]:
    cls = KVConnectorFactory.declarations_class(
        KVTransferConfig(kv_connector=name, kv_role="kv_both")
    )
    return cls.kv_transfer_kind, cls.routed_experts_support


class LogRecords(logging.Handler):
    """The messages a logger emits while this handler is added to it."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
