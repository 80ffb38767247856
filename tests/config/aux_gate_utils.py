"""Helpers for the routed-experts startup gate tests:
`VllmConfig._verify_aux_output_compatibility` called unbound on a namespace that
carries only what it reads, plus a real `KVTransferConfig`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm.config import KVTransferConfig, VllmConfig


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
