# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which KV connectors auxiliary outputs (routed experts) run with.

Contract:
- Every KV connector declares on its class what its transfers are
  (``kv_transfer_kind``) and how it keeps routed-experts rows correct
  (``routed_experts_support``); see ``KVTransferKind`` and
  ``RoutedExpertsSupport`` in ``kv_connector/v1/base.py``. This module reads
  those declarations for each connector of a ``KVTransferConfig``
  (``KVTransferConfig.iter_connector_chain``) and keeps no list of names, so an
  out-of-tree connector opts in by declaring support.
- A connector that is not registered, or whose module cannot be imported
  here, has ``KVConnectorBase_V1``'s defaults: unknown kind, unsupported.
- P/D: a P/D transport is supported when it declares ``PD_DECODE_LOADS`` (NIXL
  pull mode). The prefill instance returns the prompt's rows, the decode
  instance returns rows from its first forward on (the decode emit floor), and
  a client merges them by position. ``bidirectional_kv_xfer`` is rejected: a
  prefill-side pull of decode KV creates prefix-cache blocks without rows.
- KV loads: every other connector must declare ``BOUNDED_LOADS`` (it applies
  the load limit of ``offload.py``) or ``NO_PREFIX_LOADS``. A bounded loader
  is rejected for hybrid (attention + Mamba) models, whose prefix-hit
  reconcile path bypasses the cut of loaded blocks (``loaded_blocks.py``).
- A host-resident KV cache (``HOST_RESIDENT``, HiSparse) runs with routed
  experts only next to a P/D transport (a decode instance).
- ``enable_routed_experts_transfer`` needs routed experts on and a connector
  in the chain that declares ``transfers_routed_experts_rows`` (NIXL pull
  mode), and a model with one KV cache group (not hybrid).
- A KV offload connector that could carry rows but runs without the switch
  keeps its loads bounded; the startup log says what that costs and the
  setting that lifts it (``log_offload_without_rows_transfer``).

Failure policy: an unsupported chain fails at startup with a message that
names the connector and the connectors that declare support.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVTransferKind,
    RoutedExpertsSupport,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.config.model import ModelConfig

logger = init_logger(__name__)


def declared_kind(kv_transfer_config: KVTransferConfig) -> KVTransferKind:
    return KVConnectorFactory.declarations_class(kv_transfer_config).kv_transfer_kind


def declared_support(kv_transfer_config: KVTransferConfig) -> RoutedExpertsSupport:
    connector_cls = KVConnectorFactory.declarations_class(kv_transfer_config)
    return connector_cls.routed_experts_support


def connectors_declaring(*supports: RoutedExpertsSupport) -> str:
    """The registered connector names that declare one of ``supports``,
    grouped in the order given (for error messages: imports every module)."""
    from vllm.config.kv_transfer import KVTransferConfig

    by_support: dict[RoutedExpertsSupport, list[str]] = {s: [] for s in supports}
    for name in KVConnectorFactory.registered_connector_names():
        support = declared_support(
            KVTransferConfig(kv_connector=name, kv_role="kv_both")
        )
        if support in by_support:
            by_support[support].append(name)
    return ", ".join(name for names in by_support.values() for name in names)


def verify_routed_experts_connectors(kv_transfer_config: KVTransferConfig) -> None:
    """Reject connector chains under which routed-experts rows would be wrong."""
    chain = list(kv_transfer_config.iter_connector_chain())
    verify_host_resident_chain(chain)
    for child in chain:
        verify_pd_connector(child, declared_support(child))


def verify_loading_connectors(
    kv_transfer_config: KVTransferConfig, model_config: ModelConfig
) -> None:
    """Reject KV loaders that do not bound their loads, and bounded loaders for
    models whose prefix hits cannot be cut."""
    for child in kv_transfer_config.iter_connector_chain():
        support = declared_support(child)
        verify_loading_connector(child, support)
        if support == RoutedExpertsSupport.BOUNDED_LOADS and model_config.is_hybrid:
            # The hybrid (Mamba) prefix-hit reconcile path bypasses the cut of
            # loaded blocks, and a cut hit may end where no state is cached.
            raise ValueError(
                "--enable-return-routed-experts with "
                f"{child.kv_connector} is not supported for hybrid (attention + "
                "Mamba) models: loaded KV blocks carry no routed-experts rows "
                "and their prefix hits cannot be cut safely. Remove "
                f"{child.kv_connector} from --kv-transfer-config or disable "
                "routed experts."
            )


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


def verify_pd_connector(
    kv_transfer_config: KVTransferConfig, support: RoutedExpertsSupport
) -> None:
    name = kv_transfer_config.kv_connector
    if support == RoutedExpertsSupport.PD_DECODE_LOADS:
        if kv_transfer_config.kv_connector_extra_config.get(
            "bidirectional_kv_xfer", False
        ):
            raise ValueError(
                "--enable-return-routed-experts is incompatible with "
                f"{name} bidirectional_kv_xfer=true: a prefill-side pull of "
                "decode KV creates prefix-cache blocks without routed-experts "
                "rows. Remove bidirectional_kv_xfer from the connector's "
                "kv_connector_extra_config."
            )
        return
    if declared_kind(kv_transfer_config) == KVTransferKind.PD_TRANSFER:
        supported = connectors_declaring(RoutedExpertsSupport.PD_DECODE_LOADS)
        raise ValueError(
            f"--enable-return-routed-experts is incompatible with {name}; "
            f"P/D auxiliary output is supported with {supported} (pull "
            "mode) only."
        )


def verify_loading_connector(
    kv_transfer_config: KVTransferConfig, support: RoutedExpertsSupport
) -> None:
    if support != RoutedExpertsSupport.UNSUPPORTED:
        return
    name = kv_transfer_config.kv_connector
    supported = connectors_declaring(
        RoutedExpertsSupport.PD_DECODE_LOADS,
        RoutedExpertsSupport.BOUNDED_LOADS,
        RoutedExpertsSupport.NO_PREFIX_LOADS,
    )
    raise ValueError(
        f"--enable-return-routed-experts is incompatible with {name}: it "
        "loads KV blocks without their routed-experts rows and has no load "
        "bound for them. With routed experts, supported KV connectors are "
        f"{supported} (alone or as MultiConnector children); use "
        "OffloadingConnector or MooncakeStoreConnector for KV offload. An "
        "out-of-tree connector that bounds its loads declares "
        "routed_experts_support = RoutedExpertsSupport.BOUNDED_LOADS."
    )


def verify_host_resident_chain(chain: list[KVTransferConfig]) -> None:
    """A host-resident KV cache (HiSparse) with routed experts only on a P/D
    decode instance: colocated HiSparse with routed experts has not been run."""
    kinds = [declared_kind(child) for child in chain]
    if (
        KVTransferKind.HOST_RESIDENT in kinds
        and KVTransferKind.PD_TRANSFER not in kinds
    ):
        raise ValueError(
            "--enable-return-routed-experts with HiSparse is supported on P/D "
            "decode instances only: put NixlConnector first and "
            "HiSparseConnector after it in a MultiConnector. Colocated HiSparse "
            "with routed experts has not been run."
        )
