"""The servers of a harness deployment, built but not started: each role's
`vllm serve` command line, environment and KV connector chain, from a
`ClusterSpec` (tools/e2e/cluster_spec.py).

Every server's --kv-transfer-config (and Mooncake client file) comes from the builder
behind `vllm kv-transfer-config` (role_chains.py in the fork), given the deployment's
`Deployment`, the same code path an operator's GPU run takes; the harness only adds
what NIXL needs on a CPU host (`for_harness`). `RoleServers.servers()` returns the
servers a deployment runs: prefill(s), decode, maybe a twin prefill and the reference
for P/D; the subject, its twin and the reference for colocated offload.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.role_chains import (
    Role,
    build_role_config,
    effective_offload,
)

from tools.testbed.cpu_server import VllmServer, cpu_env, free_port
from tools.e2e.cluster_spec import KV_LEASE_SECONDS, ClusterSpec
from tools.e2e.mooncake_master import MooncakeMaster
from tools.e2e.readiness import TP_EXECUTE_MODEL_TIMEOUT_S
from tools.e2e.scenarios import BLOCK_SIZE

FAULTS_DIR = Path(__file__).resolve().parent / "faults"
# The twin prefill's namespace in a shared Mooncake store.
TWIN_CACHE_PREFIX = "e2e-twin"


def for_harness(kv_transfer_config: dict[str, Any], kv_buffer_device: str = "cpu",
                kv_load_failure_policy: str | None = None,
                kv_lease_seconds: int = KV_LEASE_SECONDS) -> dict[str, Any]:
    """A builder chain with what the harness's NIXL needs: the transfer buffer device
    (host buffers on a CPU machine), the lease (the long one above unless a run about
    expiry asks for a short one) and, when given, the KV load failure policy. Other
    connectors are left as built."""
    config = copy.deepcopy(kv_transfer_config)
    if config["kv_connector"] == "MultiConnector":
        nodes = config["kv_connector_extra_config"]["connectors"]
    else:
        nodes = [config]
    for node in nodes:
        if node["kv_connector"] == "NixlConnector":
            node["kv_buffer_device"] = kv_buffer_device
            node["kv_connector_extra_config"]["kv_lease_duration"] = kv_lease_seconds
    if kv_load_failure_policy is not None:
        config["kv_load_failure_policy"] = kv_load_failure_policy
    return config


def with_store_cache_prefix(extra: tuple[str, ...], prefix: str) -> tuple[str, ...]:
    """`--kv-transfer-config` arguments whose MooncakeStoreConnector entries (bare or
    in a MultiConnector) key their objects under `prefix`; other chains unchanged."""
    flag, text = extra
    config = json.loads(text)
    entries = config.get("kv_connector_extra_config", {}).get("connectors", [config])
    for entry in entries:
        if entry.get("kv_connector") == "MooncakeStoreConnector":
            entry.setdefault("kv_connector_extra_config", {})["cache_prefix"] = prefix
    return flag, json.dumps(config)


def parallel_args(tp: int, async_scheduling: bool) -> tuple[str, ...]:
    """A P/D role's `vllm serve` arguments for its shape."""
    args = ("--tensor-parallel-size", str(tp)) if tp > 1 else ()
    return args + (("--async-scheduling",) if async_scheduling else ())


def omp_bind(first_core: int, tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a server of `tp` ranks: one core per rank from
    `first_core` on, wrapping around this machine's cores (ranks share a core when
    there are fewer cores than ranks)."""
    cores = os.cpu_count() or 1
    return "|".join(str((first_core + rank) % cores) for rank in range(tp))


def small_kv(num_blocks: int) -> tuple[str, ...]:
    """`vllm serve` arguments for a KV cache of `num_blocks` blocks, which must still
    hold one max-length request (one block is reserved)."""
    return ("--num-gpu-blocks-override", str(num_blocks),
            "--max-model-len", str((num_blocks - 1) * BLOCK_SIZE))


def nixl_side_channel() -> dict[str, str]:
    """A NIXL side channel of its own on 127.0.0.1, for one server."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}


@dataclass
class RoleServers:
    """Builds the servers of `spec`'s deployment, logging under `logs`, with the
    Mooncake master's client settings when the deployment has one."""

    spec: ClusterSpec
    logs: Path
    master: MooncakeMaster | None = None

    def server(self, name: str, core: int, extra: tuple[str, ...],
               env_extra: dict[str, str], routed_experts: bool = True,
               fault: bool = False) -> VllmServer:
        """One `vllm serve`: the spec's serve arguments plus `extra`, its environment
        (the spec's `server_env`, else this host's CPU one pinned to `core`) plus
        `env_extra`; `fault`: it carries the spec's planted fault, if any."""
        env = (self.spec.server_env(name) if self.spec.server_env is not None
               else cpu_env(opt_in=True, core=core))
        env.update(env_extra)
        if fault and self.spec.fault:
            env["E2E_FAULT"] = self.spec.fault
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(FAULTS_DIR), os.environ.get("PYTHONPATH")]))
        args = self.spec.serve_args
        if routed_experts:
            args = ("--enable-return-routed-experts", *args)
        return VllmServer(model=self.spec.model, log_path=self.logs / f"{name}.log",
                          extra_args=args + extra, env=env,
                          enforce_eager=self.spec.enforce_eager)

    def reference(self) -> VllmServer:
        """The colocated reference: routed experts on, no KV connector, TP = 1."""
        return self.server("reference", 0, (), {})

    def role_config(self, role: Role, routed_experts_transfer: bool = True
                    ) -> tuple[tuple[str, ...], dict[str, str]]:
        """The role's --kv-transfer-config (from the builder) and Mooncake client file;
        `routed_experts_transfer=False` leaves the rows-transfer switch off whatever the
        spec says (the twin without routed experts)."""
        deployment = self.spec.deployment
        if role == "prefill":  # a decode-only flag: the prefill command line omits it
            deployment = dataclasses.replace(deployment, hisparse_host_pool_gib=None)
        # --routed-experts-transfer on the roles that set the switch (one of them for
        # the one-sided negative control).
        deployment = dataclasses.replace(
            deployment,
            routed_experts_transfer=(routed_experts_transfer
                                     and role in self.spec.routed_experts_transfer_roles))
        config = build_role_config(deployment, role,
                                   self.master.client() if self.master else None)
        print(f"e2e:   {config.summary}", flush=True)
        env: dict[str, str] = {}
        if config.mooncake_config is not None:
            path = self.logs / f"mooncake-{role}.json"
            path.write_text(json.dumps(config.mooncake_config, indent=1))
            env["MOONCAKE_CONFIG_PATH"] = str(path)
        chain = for_harness(config.kv_transfer_config, self.spec.kv_buffer_device,
                            self.spec.kv_load_failure_policy, self.spec.kv_lease_seconds)
        return ("--kv-transfer-config", json.dumps(chain)), env

    def servers(self) -> dict[str, VllmServer]:
        """The deployment's servers by name, in start order."""
        if self.spec.topology == "colocated":
            return self.colocated_servers()
        return self.pd_servers()

    def pd_servers(self) -> dict[str, VllmServer]:
        spec = self.spec
        servers: dict[str, VllmServer] = {}
        extra_prefills: list[tuple[str, Role, int]] = [
            (name, "prefill", 0) for name in spec.prefill_names[1:]]
        roles: list[tuple[str, Role, int]] = [("prefill", "prefill", 0),
                                              ("decode", "decode", 1), *extra_prefills]
        for name, role, core in roles:
            extra, env = self.role_config(role)
            env.update(nixl_side_channel())
            num_blocks = spec.offload_num_blocks if role == "prefill" else spec.decode_num_blocks
            if num_blocks is not None:
                extra += small_kv(num_blocks)
            tp = spec.decode_tp if role == "decode" else spec.prefill_tp
            extra += parallel_args(tp, spec.async_scheduling)
            if tp > 1:
                env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(core, tp)
                env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(TP_EXECUTE_MODEL_TIMEOUT_S)
            # The fault goes on decode, and on prefill too when prefill loads from offload.
            fault = role == "decode" or role in spec.roles_with_offload
            servers[name] = self.server(name, core, extra, env,
                                        routed_experts=spec.routed_experts, fault=fault)
        if self.has_prefill_twin:
            servers["twin"] = self.prefill_twin()
        if spec.reference and not spec.reference_first:
            servers["reference"] = self.reference()
        return servers

    @property
    def has_prefill_twin(self) -> bool:
        """P/D whose prefill loads from a KV offload (an offload group's small KV
        cache) gets a twin prefill without routed experts (its loads are what the
        subject's are compared with). With the shared Mooncake store the twin keeps
        its objects apart (its own `cache_prefix`), so it never loads the subject's
        and the subject never loads its rowless KV."""
        offload = effective_offload(self.spec.deployment, "prefill")
        return (self.spec.reference and offload is not None
                and "prefill" in self.spec.deployment.roles
                # an offload scenario's small KV cache, so that later turns load
                and self.spec.offload_num_blocks is not None)

    def prefill_twin(self) -> VllmServer:
        """A prefill-role server with routed experts off and the rows-transfer switch
        off; the harness sends it what the proxy sends prefill (max_tokens 1)."""
        extra, env = self.role_config("prefill", routed_experts_transfer=False)
        extra = with_store_cache_prefix(extra, TWIN_CACHE_PREFIX)
        env.update(nixl_side_channel())
        if self.spec.offload_num_blocks is not None:
            extra += small_kv(self.spec.offload_num_blocks)
        return self.server("twin", 1, extra, env, routed_experts=False)

    def colocated_servers(self) -> dict[str, VllmServer]:
        spec = self.spec
        assert spec.roles_with_offload, "a colocated deployment tests an offload connector"
        extra, env = self.role_config("colocated")
        # The twin serves without routed experts, so without the rows-transfer switch.
        twin_extra, twin_env = self.role_config("colocated", routed_experts_transfer=False)
        if spec.offload_num_blocks is not None:
            extra += small_kv(spec.offload_num_blocks)
            twin_extra += small_kv(spec.offload_num_blocks)
        servers = {
            "subject": self.server("subject", 1, extra, env, fault=True),
            "twin": self.server("twin", 0, twin_extra, twin_env, routed_experts=False),
        }
        if not spec.reference_first:
            servers["reference"] = self.reference()
        return servers
