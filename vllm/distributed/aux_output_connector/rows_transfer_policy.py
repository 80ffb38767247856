# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where ``enable_routed_experts_transfer`` (rows that travel with the KV) runs.

Contract:
- The switch needs routed experts on (``--enable-return-routed-experts``) and a
  connector in the chain that declares ``transfers_routed_experts_rows`` (NIXL
  pull mode, a KV offload connector that stores rows with its chunks); in a
  MultiConnector it is set on the MultiConnector's config and on every P/D child
  that carries rows, each child seeing only its own config.
- With the switch, the P/D connector is the chain's first (a MultiConnector gives
  a load to the first child that reports a hit), and the model has one KV cache
  group (not hybrid): rows travel in one slot per KV block of that group.
- A KV offload connector that could carry rows but runs without the switch
  keeps its loads bounded; the startup log says what that costs and the setting
  that lifts it (``log_offload_without_rows_transfer``).
- Connectors are read through their class declarations
  (``KVConnectorFactory.declarations_class``), as ``connector_policy.py`` reads
  them: an out-of-tree connector opts in by declaring.

Failure policy: a chain on which rows cannot travel fails at startup with a
message that names the field and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.aux_output_connector.connector_policy import declared_kind
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVTransferKind
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.config.model import ModelConfig

logger = init_logger(__name__)


def verify_routed_experts_transfer(
    kv_transfer_config: KVTransferConfig,
    routed_experts_enabled: bool,
    model_config: ModelConfig,
) -> None:
    """Reject ``enable_routed_experts_transfer`` where rows cannot travel.

    In a MultiConnector the switch is set on the MultiConnector's config and on
    the child that carries the rows: each child sees only its own config.
    """
    chain = list(kv_transfer_config.iter_connector_chain())
    if routed_experts_enabled:
        log_offload_without_rows_transfer(chain)
    if not kv_transfer_config.enable_routed_experts_transfer:
        flagged = [
            str(child.kv_connector)
            for child in chain
            if child is not kv_transfer_config and child.enable_routed_experts_transfer
        ]
        if flagged:
            raise ValueError(
                "enable_routed_experts_transfer=true is set on the MultiConnector "
                f"child {', '.join(flagged)} but not on the MultiConnector's "
                "kv_transfer_config; set it on both."
            )
        return
    if not routed_experts_enabled:
        raise ValueError(
            "kv_transfer_config.enable_routed_experts_transfer=true needs "
            "--enable-return-routed-experts: there are no rows to transfer. "
            "Enable routed experts on both roles, or remove "
            "enable_routed_experts_transfer."
        )
    carriers = [
        child
        for child in chain
        if KVConnectorFactory.declarations_class(child).transfers_routed_experts_rows
    ]
    # A KV offload carrier without the switch keeps its loads bounded
    # (offload.py); a P/D carrier without it would drop the rows.
    required = [
        child
        for child in carriers
        if KVConnectorFactory.declarations_class(child).kv_transfer_kind
        != KVTransferKind.KV_OFFLOAD
    ]
    if not carriers:
        names = ", ".join(str(child.kv_connector) for child in chain)
        raise ValueError(
            "kv_transfer_config.enable_routed_experts_transfer=true needs a KV "
            "connector that carries routed-experts rows with its blocks "
            "(NixlConnector in pull mode, OffloadingConnector with the native "
            "CPU tier, or MooncakeStoreConnector); this chain has "
            f"{names}. Add one of them, or remove "
            "enable_routed_experts_transfer."
        )
    unflagged = [
        str(child.kv_connector)
        for child in required
        if not child.enable_routed_experts_transfer
    ]
    if unflagged:
        raise ValueError(
            "enable_routed_experts_transfer=true is set on the MultiConnector but "
            f"not on its child {', '.join(unflagged)}, which carries the rows; "
            "set it on both."
        )
    verify_rows_carrier_first(chain)
    if model_config.is_hybrid:
        raise ValueError(
            "kv_transfer_config.enable_routed_experts_transfer=true is not "
            "supported for hybrid (attention + Mamba) models: rows travel in one "
            "slot per KV block of a single KV cache group. Remove "
            "enable_routed_experts_transfer (the P/D proxy merges the rows)."
        )


def log_offload_without_rows_transfer(chain: list[KVTransferConfig]) -> None:
    """Say at startup what a KV offload connector that could carry the rows
    costs without ``enable_routed_experts_transfer``, and how to lift it."""
    for child in chain:
        connector_cls = KVConnectorFactory.declarations_class(child)
        if (
            connector_cls.kv_transfer_kind != KVTransferKind.KV_OFFLOAD
            or not connector_cls.transfers_routed_experts_rows
            or child.enable_routed_experts_transfer
        ):
            continue
        logger.warning_once(
            "%s runs without enable_routed_experts_transfer: its chunks carry no "
            "routed-experts rows, so its loads stop at the KV block holding a "
            "request's routed_experts_prompt_start (a request that asks for rows "
            "from position 0 gets no hits from it). Set "
            '"enable_routed_experts_transfer": true in its kv_transfer_config '
            "(and on the MultiConnector's) to store the rows with the chunks "
            "(not for hybrid attention + Mamba models, which keep bounded loads).",
            child.kv_connector,
        )


def verify_rows_carrier_first(chain: list[KVTransferConfig]) -> None:
    """With rows transfer, the P/D connector must be the chain's first.

    A MultiConnector gives a request's load to the first child that reports a
    hit. The P/D connector marks a decode request whose prompt rows come with
    its KV (``mark_rows_with_kv``); a child asked before it would see the
    request unmarked, and its load, which has no rows, would not stop where the
    request's rows start.
    """
    kinds = [declared_kind(child) for child in chain]
    if KVTransferKind.PD_TRANSFER in kinds and kinds[0] != KVTransferKind.PD_TRANSFER:
        names = ", ".join(str(child.kv_connector) for child in chain)
        raise ValueError(
            "kv_transfer_config.enable_routed_experts_transfer=true needs the P/D "
            f"connector first in the MultiConnector; this chain has {names}. Put "
            "NixlConnector first (vllm kv-transfer-config prints such chains)."
        )
