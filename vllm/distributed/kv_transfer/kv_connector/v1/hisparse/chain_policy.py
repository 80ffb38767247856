# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which connector chains and CUDA-graph modes a HiSparse instance runs with.

Contract:
- HiSparse keeps sparse-MLA KV on the host and loads no prefix. It runs on
  P/D decode instances, after ``NixlConnector`` in a ``MultiConnector``.
- No KV-offload connector (one that declares
  ``kv_transfer_kind = KVTransferKind.KV_OFFLOAD``) shares its chain. The
  Mooncake store's keys have no host-layout component, so a HiSparse
  instance's payloads would be stored under the same keys as a regular
  instance's differently laid-out ones. ``OffloadingConnector`` offloads only
  the indexer groups under HiSparse, and the other offload connectors have not
  been run with it; both are rejected as policy.
- ``host_pool_gib`` is checked at startup; vLLM otherwise reads it only when
  sizing the KV cache, after the model has loaded.
- CUDA graphs: a HiSparse P/D instance defaults to ``FULL_DECODE_ONLY`` when
  no mode is chosen, the mode the reference deployment runs with (a decode
  instance's steps are uniform one-token batches; recompute after preemption
  runs eagerly). Any mode other than it or ``NONE`` logs a warning.
- These checks run after vLLM's own HiSparse checks (CUDA, no PP or DCP,
  ``--scheduler-reserve-full-isl``, a DSA model).

Failure policy: every rejected chain fails at startup, before the model
loads, with a message naming the connector and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVTransferKind
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config.kv_transfer import KVTransferConfig

logger = init_logger(__name__)

HISPARSE_CONNECTOR = "HiSparseConnector"
REFERENCE_GRAPH_MODES = (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY)


def chain_kinds(
    kv_transfer_config: KVTransferConfig | None,
) -> list[tuple[str, KVTransferKind]]:
    """(name, declared kind) of each connector in the chain."""
    if kv_transfer_config is None:
        return []
    return [
        (
            str(child.kv_connector),
            KVConnectorFactory.declarations_class(child).kv_transfer_kind,
        )
        for child in kv_transfer_config.iter_connector_chain()
    ]


def is_hisparse_pd_instance(kv_transfer_config: KVTransferConfig | None) -> bool:
    kinds = chain_kinds(kv_transfer_config)
    return any(name == HISPARSE_CONNECTOR for name, _ in kinds) and any(
        kind == KVTransferKind.PD_TRANSFER for _, kind in kinds
    )


def hisparse_cudagraph_default(
    kv_transfer_config: KVTransferConfig | None,
    cudagraph_mode: CUDAGraphMode | None,
) -> CUDAGraphMode | None:
    """FULL_DECODE_ONLY for a HiSparse P/D instance with no mode chosen,
    otherwise the mode as given."""
    if cudagraph_mode is None and is_hisparse_pd_instance(kv_transfer_config):
        logger.info(
            "HiSparse on a P/D instance: cudagraph_mode defaults to "
            "FULL_DECODE_ONLY (set -cc.cudagraph_mode to override)."
        )
        return CUDAGraphMode.FULL_DECODE_ONLY
    return cudagraph_mode


def verify_hisparse_chain(
    kv_transfer_config: KVTransferConfig | None,
    cudagraph_mode: CUDAGraphMode | None,
) -> None:
    """Reject chains HiSparse cannot run in; warn on other graph modes.

    Called when HiSparse is configured (a HiSparseConnector, or
    attention_config.hisparse_config)."""
    from vllm.config.kv_transfer import hisparse_host_pool_gib

    kinds = chain_kinds(kv_transfer_config)
    if not any(name == HISPARSE_CONNECTOR for name, _ in kinds):
        raise ValueError(
            "HiSparse requires HiSparseConnector with host_pool_gib; add "
            '{"kv_connector":"HiSparseConnector","kv_role":"kv_both",'
            '"kv_connector_extra_config":{"host_pool_gib":<GiB>}} to '
            "--kv-transfer-config (after NixlConnector in a MultiConnector)."
        )
    hisparse_host_pool_gib(kv_transfer_config)
    offload = [name for name, kind in kinds if kind == KVTransferKind.KV_OFFLOAD]
    if offload:
        raise ValueError(
            f"HiSparseConnector cannot share a kv_transfer_config with "
            f"{offload[0]}: HiSparse keeps KV in a host-resident layout that KV "
            "offload does not carry (the Mooncake store would mix it with "
            "regular payloads under the same keys). Remove "
            f"{offload[0]} from this instance's chain; keep KV offload on the "
            "prefill instances."
        )
    if cudagraph_mode is not None and cudagraph_mode not in REFERENCE_GRAPH_MODES:
        logger.warning(
            "HiSparse with cudagraph_mode=%s has not been run with this chain "
            "policy; the reference HiSparse P/D decode deployment runs with "
            "FULL_DECODE_ONLY (or NONE), which has not been run on a GPU with "
            "this policy either: set -cc.cudagraph_mode=FULL_DECODE_ONLY to "
            "match it.",
            cudagraph_mode.name,
        )
