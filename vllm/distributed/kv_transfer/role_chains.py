# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-role ``--kv-transfer-config`` chains for P/D and colocated deployments.

A deployment is described once (P/D or colocated, a shared KV offload,
per-role overrides, HiSparse on decode); ``build_role_config`` returns the
exact connector chain one role's ``vllm serve`` takes and, when that role
uses the Mooncake store, its store-client settings (the file
``MOONCAKE_CONFIG_PATH`` names).

Chain rules:
- Under P/D, ``NixlConnector`` comes first; a single connector is emitted
  bare, several are wrapped in a ``MultiConnector``.
- A role's offload is its override when set, else the shared offload. An
  override of ``off`` switches offload off for that role even when a shared
  offload is set (unset and off differ).
- A Mooncake segment of 0 bytes connects a role to the store without
  contributing memory; a store nobody contributes to is an error.
- With the Mooncake store on a P/D decode role, ``save_decode_cache`` is on
  unless switched off, so the next turn's prefill can load decode's KV.
- With ``routed_experts_transfer``, both P/D roles set
  ``enable_routed_experts_transfer`` on the chain and, in a MultiConnector, on
  its NixlConnector child too (the switch must be on both roles; the startup
  check refuses it on one of the MultiConnector and its NIXL child only).
  An offload child sets it too, on every role, when its connector declares
  that its chunks carry their rows (``transfers_routed_experts_rows``: the
  native offload's chunks, rows objects beside the Mooncake store's); a
  colocated role needs such an offload for the switch.
- ``HiSparseConnector`` is emitted on the P/D decode role only. This is the
  builder's policy: it offers HiSparse in the mode the reference deployment
  runs with (a P/D decode instance, after ``NixlConnector``), and refuses the
  HiSparse option for the prefill and colocated roles.

Two kinds of checks, each rule in one place:
- ``validate_deployment`` holds the rules about this builder's own options
  (which options apply to which role, sizes, the shared store, the
  save_decode_cache switch).
- What ``vllm serve`` checks in a chain is not restated here: every role's
  built chain is parsed with ``KVTransferConfig`` and, when it has
  ``HiSparseConnector``, run through ``verify_hisparse_chain``, the check
  ``vllm serve`` runs at startup (HiSparse next to KV offload, host_pool_gib);
  a Mooncake role's client file is read with ``MooncakeStoreConfig.from_file``.

Failure policy: a deployment that has any role this module cannot build a
working chain for raises ``RoleConfigError`` naming the option and the fix,
and nothing is emitted, even for a role that alone would be fine.
"""

import json
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["prefill", "decode", "colocated"]
OffloadKind = Literal["native", "mooncake"]
PD_ROLES: tuple[Role, ...] = ("prefill", "decode")
OFF = "off"
HISPARSE_CONNECTOR = "HiSparseConnector"

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


class RoleConfigError(ValueError):
    """A deployment for which no working per-role chain exists."""


@dataclass(frozen=True)
class Offload:
    """A role's KV offload: vLLM's native CPU tier or the Mooncake store."""

    kind: OffloadKind
    num_bytes: int

    def describe(self) -> str:
        """What the offload is, for the summary line."""
        if self.kind == "native":
            return f"native CPU offload ({format_bytes(self.num_bytes)})"
        if self.num_bytes == 0:
            return "Mooncake store (0-byte segment: uses the store, adds no memory)"
        return f"Mooncake store ({format_bytes(self.num_bytes)} segment)"

    def spec(self) -> str:
        """The SPEC the options take, e.g. native:64GiB or mooncake:0."""
        for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
            if self.num_bytes >= size and self.num_bytes % size == 0:
                return f"{self.kind}:{self.num_bytes // size}{unit}"
        return f"{self.kind}:{self.num_bytes}"

    @property
    def connector(self) -> str:
        """The connector that carries this offload."""
        return (
            "OffloadingConnector" if self.kind == "native" else "MooncakeStoreConnector"
        )


# A per-role override: None inherits the shared offload, OFF switches it off.
OffloadOverride = Offload | Literal["off"] | None


@dataclass(frozen=True)
class Deployment:
    """Everything that decides the chains of a deployment's roles."""

    pd: bool
    offload: Offload | None = None
    prefill_offload: OffloadOverride = None
    decode_offload: OffloadOverride = None
    # None: on exactly when a P/D decode role uses the Mooncake store.
    save_decode_cache: bool | None = None
    hisparse_host_pool_gib: float | None = None
    nixl_num_threads: int = 1
    # Routed-experts rows travel with the KV over NIXL (both P/D roles).
    routed_experts_transfer: bool = False

    @property
    def roles(self) -> tuple[Role, ...]:
        return PD_ROLES if self.pd else ("colocated",)


@dataclass(frozen=True)
class MooncakeClient:
    """Where a role's Mooncake store client connects (not the store's size)."""

    master_server_address: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "rdma"
    device_name: str = ""
    local_buffer_size: str | None = None


@dataclass(frozen=True)
class RoleConfig:
    """What one role's vllm serve takes, and a one-line summary of it."""

    role: Role
    kv_transfer_config: dict[str, Any]
    # The MOONCAKE_CONFIG_PATH contents; None when the role has no Mooncake.
    mooncake_config: dict[str, Any] | None
    summary: str


def parse_bytes(text: str, option: str) -> int:
    """'64GiB', '64GB', '512M', '0' -> bytes (binary units, as Mooncake reads them)."""
    match = _SIZE.match(text)
    if match is None:
        raise RoleConfigError(
            f"{option}: cannot read {text!r} as a size; write a byte count such "
            "as 0, 512MiB or 64GiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(num_bytes: int) -> str:
    """64 GiB, 512 MiB, or a byte count when no binary unit divides it."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if num_bytes >= size and num_bytes % size == 0:
            return f"{num_bytes // size} {unit}"
    return f"{num_bytes} bytes"


def parse_offload(text: str, option: str) -> Offload | Literal["off"]:
    """'off' | 'none' | 'native:<bytes>' | 'mooncake:<segment bytes>'."""
    value = text.strip().lower()
    if value in (OFF, "none"):
        return OFF
    kind, sep, size = value.partition(":")
    if not sep or kind not in ("native", "mooncake"):
        raise RoleConfigError(
            f"{option}: {text!r} is not an offload; write off, "
            "native:<bytes> (e.g. native:64GiB) or mooncake:<segment bytes> "
            "(e.g. mooncake:64GiB, or mooncake:0 to use the store without "
            "contributing memory)"
        )
    return Offload(kind, parse_bytes(size, option))  # type: ignore[arg-type]


def role_override(deployment: Deployment, role: Role) -> OffloadOverride:
    """The role's --prefill-offload / --decode-offload (None for colocated)."""
    if role == "prefill":
        return deployment.prefill_offload
    if role == "decode":
        return deployment.decode_offload
    return None


def offload_option(deployment: Deployment, role: Role) -> str:
    """The option the role's offload comes from: its override, or --offload."""
    if role_override(deployment, role) is not None:
        return f"--{role}-offload"
    return "--offload"


def offload_off_option(role: Role) -> str:
    """The option that switches offload off for the role alone."""
    return "--offload off" if role == "colocated" else f"--{role}-offload off"


def effective_offload(deployment: Deployment, role: Role) -> Offload | None:
    """The role's override when set, else the shared offload; OFF is None."""
    override = role_override(deployment, role)
    if override == OFF:
        return None
    if override is not None:
        return override  # type: ignore[return-value]
    return deployment.offload


def saves_decode_cache(deployment: Deployment, role: Role) -> bool:
    """Whether the role's Mooncake child sets save_decode_cache."""
    offload = effective_offload(deployment, role)
    if offload is None or offload.kind != "mooncake":
        return False
    if deployment.save_decode_cache is not None:
        return deployment.save_decode_cache and role != "prefill"
    return role == "decode"


def validate_deployment(deployment: Deployment) -> None:
    """Raise RoleConfigError for the first rule the deployment breaks: the
    builder's own option rules, then vLLM's checks on every role's chain."""
    check_colocated_options(deployment)
    check_routed_experts_transfer(deployment)
    check_native_tiers(deployment)
    check_mooncake_store(deployment)
    check_save_decode_cache(deployment)
    for role in deployment.roles:
        chain = role_chain(deployment, role)
        if chain:
            verify_chain_with_vllm(deployment, role, wrap_role_chain(deployment, chain))


def check_colocated_options(deployment: Deployment) -> None:
    """Options that apply to P/D roles only."""
    if deployment.pd:
        return
    for name in ("prefill_offload", "decode_offload"):
        if getattr(deployment, name) is not None:
            option = "--" + name.replace("_", "-")
            raise RoleConfigError(
                f"{option} applies to P/D roles; a colocated instance takes "
                "its offload from --offload"
            )
    if deployment.hisparse_host_pool_gib is not None:
        raise RoleConfigError(
            "--hisparse-host-pool-gib with --role colocated: this builder adds "
            "HiSparseConnector to the P/D decode role only (builder policy: it "
            "offers HiSparse in the mode the reference deployment runs with, a "
            "P/D decode instance after NixlConnector). Use --role decode for a "
            "P/D deployment, or drop --hisparse-host-pool-gib"
        )


def check_routed_experts_transfer(deployment: Deployment) -> None:
    """Rows travel with the KV over NIXL (P/D) and with the chunks of an offload
    whose connector carries them, so a colocated role needs such an offload for
    the switch."""
    if not deployment.routed_experts_transfer or deployment.pd:
        return
    offload = effective_offload(deployment, "colocated")
    if offload is not None and carries_rows(offload.connector):
        return
    what = "no KV offload" if offload is None else offload.describe()
    kinds: tuple[OffloadKind, ...] = ("native", "mooncake")
    carriers = [
        f"--offload {kind}:SIZE"
        for kind in kinds
        if carries_rows(Offload(kind, 0).connector)
    ]
    add = f"add {' or '.join(carriers)}, " if carriers else ""
    raise RoleConfigError(
        f"--routed-experts-transfer with --role colocated and {what}: "
        "routed-experts rows travel with the KV over NixlConnector (P/D) "
        "and with the chunks of an offload that carries them, and a colocated "
        "instance without one returns every row anyway. Drop "
        f"--routed-experts-transfer, {add}or build the P/D roles (--role "
        "prefill and --role decode)"
    )


def check_native_tiers(deployment: Deployment) -> None:
    """A native offload needs a CPU tier of some size."""
    for role in deployment.roles:
        offload = effective_offload(deployment, role)
        if offload is not None and offload.kind == "native" and offload.num_bytes == 0:
            option = offload_option(deployment, role)
            raise RoleConfigError(
                f"{option} native:0: native offload needs a CPU tier, and the "
                f"{role} role would get a 0-byte one. Give it a size (e.g. "
                f"{option} native:64GiB) or switch offload off for this role "
                f"({offload_off_option(role)})"
            )


def check_mooncake_store(deployment: Deployment) -> None:
    """A shared store some role contributes memory to."""
    mooncake = mooncake_roles(deployment)
    if mooncake and all(o.num_bytes == 0 for o in mooncake.values()):
        example = (
            "--prefill-offload mooncake:64GiB"
            if deployment.pd
            else "--offload mooncake:64GiB"
        )
        raise RoleConfigError(
            f"Mooncake store: every role using it ({', '.join(mooncake)}) "
            "contributes a 0-byte segment, so the store has no memory. Give at "
            f"least one role a segment, e.g. {example}"
        )


def check_save_decode_cache(deployment: Deployment) -> None:
    """--save-decode-cache needs the store on the role that decodes."""
    if not deployment.save_decode_cache:
        return
    decoder: Role = "decode" if deployment.pd else "colocated"
    if decoder in mooncake_roles(deployment):
        return
    example = (
        "--decode-offload mooncake:0" if deployment.pd else "--offload mooncake:64GiB"
    )
    raise RoleConfigError(
        f"--save-decode-cache: the {decoder} role does not use the Mooncake "
        "store, so there is no decode KV to save; give it the store (e.g. "
        f"{example}) or drop --save-decode-cache"
    )


def mooncake_roles(deployment: Deployment) -> dict[Role, Offload]:
    """The roles whose offload is the Mooncake store, with their segments."""
    offloads = {role: effective_offload(deployment, role) for role in deployment.roles}
    return {
        role: offload
        for role, offload in offloads.items()
        if offload is not None and offload.kind == "mooncake"
    }


def verify_chain_with_vllm(
    deployment: Deployment, role: Role, chain: dict[str, Any]
) -> None:
    """Parse the role's chain as `vllm serve` does and run its startup check
    for HiSparse chains, so a chain vLLM rejects is refused here."""
    from pydantic import ValidationError

    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.chain_policy import (
        verify_hisparse_chain,
    )

    try:
        kv_transfer_config = KVTransferConfig(**chain)
    except ValidationError as exc:
        raise RoleConfigError(
            f"{role} role: the chain this builder made does not parse as "
            f"vLLM's KVTransferConfig: {exc}"
        ) from exc
    if not has_hisparse(chain):
        return
    try:
        verify_hisparse_chain(kv_transfer_config, cudagraph_mode=None)
    except ValueError as exc:
        raise RoleConfigError(
            f"{role} role: vllm serve rejects this chain: {exc} "
            f"{chain_sources(deployment, role)}"
        ) from exc


def has_hisparse(chain: dict[str, Any]) -> bool:
    """Whether the printed chain (bare or a MultiConnector) has HiSparse."""
    children = [chain]
    if chain["kv_connector"] == "MultiConnector":
        children = chain["kv_connector_extra_config"]["connectors"]
    return any(child["kv_connector"] == HISPARSE_CONNECTOR for child in children)


def chain_sources(deployment: Deployment, role: Role) -> str:
    """Which option put each non-NIXL connector into the role's chain."""
    sources = []
    offload = effective_offload(deployment, role)
    if offload is not None:
        sources.append(
            f"{offload.connector} from {offload_option(deployment, role)} "
            f"{offload.spec()} ({offload_off_option(role)} removes it from "
            "this role)"
        )
    gib = deployment.hisparse_host_pool_gib
    if role == "decode" and gib is not None:
        sources.append(f"{HISPARSE_CONNECTOR} from --hisparse-host-pool-gib {gib:g}")
    return "Options behind this chain: " + ", ".join(sources) + "."


def verify_mooncake_client(role: Role, config: dict[str, Any]) -> None:
    """Read the role's store-client file the way the store client reads
    MOONCAKE_CONFIG_PATH, sizes included."""
    from vllm.distributed.mooncake_store import MooncakeStoreConfig

    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(config, file)
        file.flush()
        try:
            MooncakeStoreConfig.from_file(file.name)
        except ValueError as exc:
            hint = ""
            if "local_buffer_size" in config:
                hint = (
                    f"; check --mooncake-local-buffer "
                    f"{config['local_buffer_size']!r} (a size such as 512MB or 1GB)"
                )
            raise RoleConfigError(
                f"{role} role: the Mooncake client file does not load with "
                f"vLLM's MooncakeStoreConfig.from_file: {exc}{hint}"
            ) from exc


def _child(connector: str, extra: dict[str, Any]) -> dict[str, Any]:
    """One connector entry of a chain."""
    return {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def _offload_child(deployment: Deployment, role: Role) -> dict[str, Any] | None:
    """The role's offload connector entry, or None without offload."""
    offload = effective_offload(deployment, role)
    if offload is None:
        return None
    if offload.kind == "native":
        child = _child(offload.connector, {"cpu_bytes_to_use": offload.num_bytes})
    else:
        extra = (
            {"save_decode_cache": True} if saves_decode_cache(deployment, role) else {}
        )
        child = _child(offload.connector, extra)
    if deployment.routed_experts_transfer and carries_rows(offload.connector):
        child["enable_routed_experts_transfer"] = True
    return child


def carries_rows(connector: str) -> bool:
    """Whether ``connector`` declares that its loads bring the routed-experts rows
    of their blocks (``KVConnectorBase_V1.transfers_routed_experts_rows``)."""
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = KVTransferConfig(kv_connector=connector, kv_role="kv_both")
    return KVConnectorFactory.declarations_class(config).transfers_routed_experts_rows


def role_chain(deployment: Deployment, role: Role) -> list[dict[str, Any]]:
    """The role's connectors in order: NIXL (P/D), offload, HiSparse (decode)."""
    chain: list[dict[str, Any]] = []
    if deployment.pd:
        nixl = _child("NixlConnector", {"num_threads": deployment.nixl_num_threads})
        if deployment.routed_experts_transfer:
            nixl["enable_routed_experts_transfer"] = True
        chain.append(nixl)
    offload = _offload_child(deployment, role)
    if offload is not None:
        chain.append(offload)
    if role == "decode" and deployment.hisparse_host_pool_gib is not None:
        chain.append(
            _child(
                HISPARSE_CONNECTOR,
                {"host_pool_gib": deployment.hisparse_host_pool_gib},
            )
        )
    return chain


def wrap_chain(chain: list[dict[str, Any]]) -> dict[str, Any]:
    """One connector bare; several in a MultiConnector, in order."""
    if len(chain) == 1:
        return chain[0]
    return _child("MultiConnector", {"connectors": chain})


def wrap_role_chain(
    deployment: Deployment, chain: list[dict[str, Any]]
) -> dict[str, Any]:
    """The role's printed chain: wrapped, with the rows-transfer switch on the
    top-level config too (a MultiConnector's own config needs it as well)."""
    config = wrap_chain(chain)
    if deployment.routed_experts_transfer:
        config["enable_routed_experts_transfer"] = True
    return config


def mooncake_client_config(offload: Offload, client: MooncakeClient) -> dict[str, Any]:
    """The role's MOONCAKE_CONFIG_PATH contents. A 0-byte segment needs
    standalone-store mode (vLLM refuses it in embedded mode)."""
    config: dict[str, Any] = {
        "metadata_server": client.metadata_server,
        "master_server_address": client.master_server_address,
        "protocol": client.protocol,
        "device_name": client.device_name,
        "mode": "standalone-store" if offload.num_bytes == 0 else "embedded",
        "global_segment_size": offload.num_bytes,
    }
    if client.local_buffer_size is not None:
        config["local_buffer_size"] = client.local_buffer_size
    return config


def build_role_config(
    deployment: Deployment,
    role: Role,
    client: MooncakeClient | None = None,
) -> RoleConfig:
    """The role's --kv-transfer-config and Mooncake client settings."""
    check_role(deployment, role)
    validate_deployment(deployment)
    chain = role_chain(deployment, role)
    if not chain:
        raise RoleConfigError(
            "--role colocated without --offload: a colocated instance without "
            "KV offload needs no --kv-transfer-config; for one, add --offload "
            "native:<bytes> or --offload mooncake:<bytes>"
        )
    client = client or MooncakeClient()
    clients = {
        name: mooncake_client_config(offload, client)
        for name, offload in mooncake_roles(deployment).items()
    }
    for name in sorted(clients, key=lambda other: other != role):  # role first
        verify_mooncake_client(name, clients[name])
    return RoleConfig(
        role=role,
        kv_transfer_config=wrap_role_chain(deployment, chain),
        mooncake_config=clients.get(role),
        summary=describe_chain(deployment, role),
    )


def check_role(deployment: Deployment, role: Role) -> None:
    """The role is one of the deployment's, and takes the options given."""
    if role not in deployment.roles:
        if deployment.pd:
            raise RoleConfigError(
                f"--role {role}: this deployment is P/D (Deployment.pd is True), "
                "whose roles are prefill and decode; use --role prefill or "
                "--role decode"
            )
        raise RoleConfigError(
            f"--role {role}: this deployment is colocated (Deployment.pd is "
            "False), whose one role is colocated; use --role colocated"
        )
    if role == "prefill" and deployment.hisparse_host_pool_gib is not None:
        raise RoleConfigError(
            "--hisparse-host-pool-gib with --role prefill: this builder adds "
            "HiSparseConnector to the decode role only (builder policy: it "
            "offers HiSparse in the mode the reference deployment runs with, a "
            "P/D decode instance after NixlConnector). Build the prefill config "
            "without --hisparse-host-pool-gib"
        )


def describe_chain(deployment: Deployment, role: Role) -> str:
    """One line for logs: the role's connectors and what each is for."""
    parts = []
    if deployment.pd:
        parts.append(
            "NixlConnector (P/D KV transfer, routed-experts rows with the KV)"
            if deployment.routed_experts_transfer
            else "NixlConnector (P/D KV transfer)"
        )
    offload = effective_offload(deployment, role)
    if offload is not None:
        text = offload.describe()
        if deployment.routed_experts_transfer:
            text += ", routed-experts rows with the chunks"
        if saves_decode_cache(deployment, role):
            text += ", saves decode KV"
        parts.append(text)
    gib = deployment.hisparse_host_pool_gib
    if role == "decode" and gib is not None:
        parts.append(f"{HISPARSE_CONNECTOR} ({gib:g} GiB host pool)")
    return f"{role}: " + " -> ".join(parts)
