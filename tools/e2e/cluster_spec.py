"""What a harness deployment is: `ClusterSpec`, the description `Cluster`
(tools/e2e/cluster.py) starts, and the offload tiers and serve arguments it names.

A description only: nothing here starts a process or reads the network.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm.distributed.kv_transfer.role_chains import (
    Deployment,
    Offload,
    Role,
    effective_offload,
)

from tools.testbed.spinners import SPINNER_NICE
from tools.e2e.scenarios import BLOCK_SIZE

# A 32-token KV block (the CPU default is 128; CPU attention needs a multiple of 32)
# puts block boundaries within reach of short prompts; float32 keeps near-tie expert
# choices from flipping between runs.
CPU_SERVE_ARGS: tuple[str, ...] = ("--dtype", "float32", "--block-size", str(BLOCK_SIZE))

# NIXL's prefill side frees a request's blocks when its lease (30 s by default)
# runs out before the decode side has read them. A decode instance with a tiny
# KV cache on a 2-core CPU can keep requests waiting longer than that, and
# vLLM 0.31.0 then reads the freed, reused blocks and decodes from the wrong KV
# (prefill logs "Releasing expired KV blocks"; see docs/r3-pd.md). The harness
# tests routing rows, not lease expiry, so it gives the lease ample room.
KV_LEASE_SECONDS = 900


def native(num_bytes: int = 1 << 26) -> Offload:
    """vLLM's OffloadingConnector with a CPU tier of `num_bytes` (64 MiB)."""
    return Offload("native", num_bytes)


def mooncake(segment_bytes: int) -> Offload:
    """The Mooncake store; the role adds `segment_bytes` of memory to it (0: none)."""
    return Offload("mooncake", segment_bytes)


def mooncake_pd(segment_bytes: int = 256 << 20) -> Deployment:
    """1P1D over NIXL with the Mooncake store on both roles: prefill gives it
    `segment_bytes` (256 MiB), decode only uses it (a 0-byte segment) and, by the
    builder's default, saves its decode-phase KV there."""
    return Deployment(pd=True, offload=mooncake(segment_bytes), decode_offload=mooncake(0))


@dataclass
class ClusterSpec:
    model: Path
    decode_num_blocks: int | None = None  # --num-gpu-blocks-override on decode
    fault: str | None = None  # planted on the server(s) under test
    # The harness checks rows against colocated serving, so at P - 1 (computed by
    # both instances) it keeps prefill's row, as colocated does, and counts flips.
    overlap: str = "prefill"
    # The connector chains, as `vllm kv-transfer-config` takes them: P/D roles get NIXL
    # plus each role's own offload; a colocated subject gets the shared offload.
    deployment: Deployment = field(default_factory=lambda: Deployment(pd=True))
    offload_num_blocks: int | None = None  # the small KV cache beside prefill's offload
    # `vllm serve` arguments besides routed experts and the chain (CPU: float32, 32-token
    # blocks), and NIXL's buffer device; a GPU run passes its own (tools/e2e --help).
    serve_args: tuple[str, ...] = CPU_SERVE_ARGS
    kv_buffer_device: str = "cpu"
    enforce_eager: bool = True
    # Rows travel with the KV (enable_routed_experts_transfer) instead of the proxy merge.
    routed_experts_transfer: bool = False
    # The switch on this P/D role only: a one-sided switch, which decode's NIXL handshake
    # must refuse (a negative control).
    routed_experts_transfer_only_on: Role | None = None
    # What sits in front of P/D: "pdproxy" (merges rows) or "vllm-router" (decode's
    # response as is).
    router: str = "pdproxy"
    kv_load_failure_policy: str | None = None  # None: as the builder sets it
    # NIXL's kv_lease_duration on both roles; short only where a run is about expiry.
    kv_lease_seconds: int = KV_LEASE_SECONDS
    # The nice value given to threads busy while the deployment idles (NIXL's
    # progress threads, tools/testbed/spinners.py); 0 leaves them as they start.
    spinner_nice: int = SPINNER_NICE
    # Prefill instances in front of the one decode (xPyD): "prefill", "prefill-1", ...
    num_prefill: int = 1
    # The colocated reference server; a benchmark that checks nothing against it
    # leaves it out.
    reference: bool = True
    # Deployment shape of the P/D roles (docs/deployment-shapes.md): each role's
    # tensor-parallel size, and asynchronous scheduling on both. The reference stays
    # TP = 1 with synchronous scheduling: in float32 a TP = 2 forward picks the same
    # experts as TP = 1, so heterogeneous P/D must equal it exactly.
    prefill_tp: int = 1
    decode_tp: int = 1
    async_scheduling: bool = False
    # Check rows against transformers' router top-k (tools/testbed/router_oracle.py)
    # instead of the reference's rows, allowing flips where the k-th and (k + 1)-th
    # router logits are closer than this; tokens are compared with the
    # reference and counted only. For bf16 shapes whose TP is not the reference's.
    rows_oracle_margin: float | None = None
    # Routed experts on the P/D roles (--enable-return-routed-experts); off for the
    # baseline a benchmark divides by.
    routed_experts: bool = True
    # Each server's environment by name ("prefill", "decode", ...); None: this host's
    # CPU environment pinned to the role's core (cpu_env). A GPU run gives each role
    # its devices (benchmarks/gpu/r3_cost.py).
    server_env: Callable[[str], dict[str, str]] | None = None
    # Serve the reference alone first, record its answers, stop it, then start the
    # deployment and check it against the recorded answers. On a host with fewer
    # cores than engines (a TP = 2 role, 2 cores) the reference beside the
    # deployment takes a core from a rank that has work (docs/deployment-shapes.md).
    # The reference's answers do not depend on the deployment's: a conversation's
    # next turn is built from the reference's answer.
    reference_first: bool = False

    @property
    def topology(self) -> str:
        """"pd" (prefill + decode + proxy) or "colocated" (subject + twin)."""
        return "pd" if self.deployment.pd else "colocated"

    @property
    def routed_experts_transfer_roles(self) -> tuple[Role, ...]:
        """The P/D roles whose chain sets enable_routed_experts_transfer."""
        if self.routed_experts_transfer_only_on is not None:
            return (self.routed_experts_transfer_only_on,)
        return ("prefill", "decode", "colocated") if self.routed_experts_transfer else ()

    @property
    def roles_with_offload(self) -> list[Role]:
        return [r for r in self.deployment.roles
                if effective_offload(self.deployment, r) is not None]

    @property
    def uses_mooncake(self) -> bool:
        return any(o is not None and o.kind == "mooncake"
                   for o in (effective_offload(self.deployment, r)
                             for r in self.deployment.roles))

    @property
    def prefill_names(self) -> list[str]:
        """The prefill servers' names: "prefill", then "prefill-1", ... (xPyD)."""
        return ["prefill", *(f"prefill-{i}" for i in range(1, self.num_prefill))]
