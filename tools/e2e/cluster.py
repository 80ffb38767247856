"""The deployments the equivalence harness drives, all real processes on 127.0.0.1.

Every server's --kv-transfer-config (and Mooncake client file) comes from the builder
behind `vllm kv-transfer-config` (role_chains.py in the fork), given the deployment's
`Deployment`, the same code path an operator's GPU run takes; the harness only adds
what NIXL needs on a CPU host (`for_harness`).

P/D (topology "pd"):
- prefill: `vllm serve` with NixlConnector (host buffers, UCX over TCP), optionally
  chained with its KV offload (MultiConnector [NIXL, offload]) and a small KV cache, so
  later turns reload earlier ones from offload;
- decode: the same with its own offload; optionally a tiny KV cache to force preemption;
- proxy: the installed `vllm-r3-pdproxy` (pdproxy/), or the `vllm-router` P/D router
  (`router="vllm-router"`), which forwards decode's response alone; with
  `routed_experts_transfer` both roles are built with `--routed-experts-transfer`
  (`enable_routed_experts_transfer`) and decode returns every row.
Colocated with offload (topology "colocated"):
- subject: one `vllm serve` with a KV-offload connector and a small KV cache;
- twin: the same server with routed experts off, whose loads nothing limits (the
  "withheld by the clamp" count is the twin's loaded tokens minus the subject's).
P/D whose prefill has a native CPU offload tier gets a twin prefill the same way, sent
what the proxy sends prefill (the prompt, one token).
Both have a reference: a colocated `vllm serve` with the same model, routed experts on,
no connector and a KV cache large enough that nothing is evicted.
The server under test (decode, or the colocated subject; prefill too with offload)
can carry a planted fault (E2E_FAULT, see faults/sitecustomize.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.role_chains import (
    Deployment,
    Offload,
    Role,
    build_role_config,
    effective_offload,
)

from tools.testbed.cpu_server import (
    ProcessOutlivedKill,
    VllmServer,
    cpu_env,
    free_port,
    post_json,
    stop_process_group,
)
from tools.testbed.spinners import (
    SPINNER_NICE,
    deprioritise,
    process_tree,
    spinning_threads,
)
from tools.testbed.metrics import read_total
from tools.testbed.stalls import stall_report
from tools.testbed.warm_tp_compile import WORKER_INDUCTOR_ENV
from tools.e2e.mooncake_master import MooncakeMaster
from tools.e2e.scenarios import BLOCK_SIZE, prompt_ids

FAULTS_DIR = Path(__file__).resolve().parent / "faults"
REPO_ROOT = Path(__file__).resolve().parents[2]
# A 32-token KV block (the CPU default is 128; CPU attention needs a multiple of 32)
# puts block boundaries within reach of short prompts; float32 keeps near-tie expert
# choices from flipping between runs.
CPU_SERVE_ARGS = ("--dtype", "float32", "--block-size", str(BLOCK_SIZE))


# NIXL's prefill side frees a request's blocks when its lease (30 s by default)
# runs out before the decode side has read them. A decode instance with a tiny
# KV cache on a 2-core CPU can keep requests waiting longer than that, and
# vLLM 0.31.0 then reads the freed, reused blocks and decodes from the wrong KV
# (prefill logs "Releasing expired KV blocks"; see docs/r3-pd.md). The harness
# tests routing rows, not lease expiry, so it gives the lease ample room.
KV_LEASE_SECONDS = 900


# The fork's per-request gauges (docs/metrics.md): 0 on a server whose requests have
# all finished; anything else is leaked state (the harness and the soak read them).
LEAK_GAUGES = ("vllm:routed_experts_tracked_requests", "vllm:routed_experts_emit_floors")
# vLLM's share of the KV cache in use: 0 on an idle server (cached blocks count as free).
KV_USAGE = "vllm:kv_cache_usage_perc"


def unwind_on_sigterm() -> None:
    """Make SIGTERM (a test's timeout, CI cancelling) unwind through `Cluster.stop()`:
    the servers run in sessions of their own and would outlive an entry point killed
    outright."""
    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


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


def _console_script(name: str, install: str) -> str:
    """The console script `name` installed beside this interpreter."""
    script = Path(sys.executable).parent / name
    if not script.is_file():
        raise RuntimeError(f"{script} is missing: {install} (tools/setup-test-env.sh does)")
    return str(script)


# vllm-router checks each worker's /health every 60 s with a 5 s timeout and marks it
# unavailable after 3 failed checks; then every request is "503 No available workers".
# On a 2-core machine running three servers a decode's /health measured 32 s and 60 s
# (a CI run and a local rerun, 2026-12-03), so a live decode was dropped in the
# middle of a scenario. A dead server still fails its check at once (connection
# refused); only a slow answer is tolerated.
ROUTER_HEALTH_ARGS = ("--health-check-timeout-secs", "180")


def router_executable() -> str:
    """The `vllm-router` P/D router."""
    return _console_script("vllm-router", "pip install vllm-router==0.1.17")


def proxy_executable() -> str:
    """The P/D proxy, `vllm-r3-pdproxy`."""
    return _console_script("vllm-r3-pdproxy", "install the P/D proxy into this "
                           "environment (pip install ./pdproxy)")


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


# The twin prefill's namespace in a shared Mooncake store.
TWIN_CACHE_PREFIX = "e2e-twin"


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


# A server of TP > 1 compiles upstream's VocabParallelEmbedding input mask with
# torch.compile (Inductor) on its first forward. Cold (a fresh machine, a new dtype)
# on a loaded 2-core host that took longer than vLLM's 300 s for one execute_model,
# and the engine died with "RPC call to execute_model timed out"
# (docs/deployment-shapes.md). The harness gives the first forward room instead.
TP_EXECUTE_MODEL_TIMEOUT_S = 1800
# The first P/D request waits for that first forward: post_json's default otherwise.
FIRST_REQUEST_TIMEOUT_S = 300.0
# How long a server may take to answer /health, and how often a deployment is started
# before its start fails (Cluster.start; docs/testing.md says why it is retried).
SERVER_READY_TIMEOUT_S = 600.0
START_ATTEMPTS = 2
# What the host's threads did while a start or a request waited long, beside the
# servers' logs (tools/testbed/stalls.py).
STALLS_LOG = "stalls.log"
# Each deployment's requests, sent and answered (the harness writes it).
REQUESTS_LOG = "requests.log"


def first_request_timeout(prefill_tp: int, decode_tp: int) -> float:
    """How long the first P/D request may take: a TP > 1 role's first forward gets
    the room its execute_model timeout gives it."""
    if max(prefill_tp, decode_tp) > 1:
        return float(TP_EXECUTE_MODEL_TIMEOUT_S)
    return FIRST_REQUEST_TIMEOUT_S


# Models whose TP embedding mask this process has compiled (warm_tp_compile).
_WARMED: set[tuple[str, int]] = set()


def warm_tp_compile(model: Path, tp: int) -> None:
    """Compile upstream's TP embedding mask into Inductor's cache before a server of
    `tp` ranks starts (tools/testbed/warm_tp_compile.py), once per model and TP in
    this process: the servers' first forward then finds the C++ compiled (11 s cold,
    3.5 s warmed for a TP = 2 server's first request on an idle 2-core VM), and the
    first P/D request waits that much less. Best effort: a failure is printed and the
    servers compile it themselves, within TP_EXECUTE_MODEL_TIMEOUT_S."""
    key = (str(model), tp)
    if tp < 2 or key in _WARMED:
        return
    config = json.loads((model / "config.json").read_text())
    vocab_size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if vocab_size is None:
        print(f"e2e:   {model}/config.json has no vocab_size; the TP {tp} servers "
              "compile their embedding mask on their first forward", flush=True)
        return
    env = cpu_env()
    env.update(WORKER_INDUCTOR_ENV)
    command = [sys.executable, "-m", "tools.testbed.warm_tp_compile",
               "--vocab-size", str(vocab_size), "--tp", str(tp)]
    start = time.monotonic()
    result = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        print(f"e2e:   warming the TP {tp} embedding-mask compile failed (exit "
              f"{result.returncode}); the servers compile it on their first forward:\n"
              f"{(result.stdout + result.stderr)[-2000:]}", flush=True)
        return
    _WARMED.add(key)
    print(f"e2e:   TP {tp} embedding-mask compile warmed in "
          f"{time.monotonic() - start:.0f} s", flush=True)


def omp_bind(first_core: int, tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a server of `tp` ranks: one core per rank from
    `first_core` on, wrapping around this machine's cores (ranks share a core when
    there are fewer cores than ranks)."""
    cores = os.cpu_count() or 1
    return "|".join(str((first_core + rank) % cores) for rank in range(tp))


def _small_kv(num_blocks: int) -> tuple[str, ...]:
    # The KV cache must still hold one max-length request (one block is reserved).
    return ("--num-gpu-blocks-override", str(num_blocks),
            "--max-model-len", str((num_blocks - 1) * BLOCK_SIZE))


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


@dataclass
class Cluster:
    spec: ClusterSpec
    logs: Path
    servers: dict[str, VllmServer] = field(default_factory=dict)
    proxy_process: subprocess.Popen[bytes] | None = None
    proxy_port: int = field(default_factory=free_port)
    master: MooncakeMaster | None = None
    # The reference-first run (ClusterSpec.reference_first): the reference's answers
    # by request body (json.dumps(body, sort_keys=True)), and whether this cluster is
    # the reference alone recording them or the deployment checked against them.
    reference_answers: dict[str, dict[str, Any]] | None = None
    only_reference: bool = False
    # Starts that timed out and were retried (Cluster.start).
    restarts: int = 0

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def _server(self, name: str, core: int, extra: tuple[str, ...],
                env_extra: dict[str, str], routed_experts: bool = True,
                fault: bool = False) -> VllmServer:
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

    def _reference_server(self) -> VllmServer:
        """The colocated reference: routed experts on, no KV connector, TP = 1."""
        return self._server("reference", 0, (), {})

    def _role_config(self, role: Role, routed_experts_transfer: bool = True
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

    @property
    def prefill_names(self) -> list[str]:
        """The prefill servers' names: "prefill", then "prefill-1", ... (xPyD)."""
        return ["prefill", *(f"prefill-{i}" for i in range(1, self.spec.num_prefill))]

    def _pd_servers(self) -> dict[str, VllmServer]:
        spec = self.spec
        servers = {}
        extra_prefills = [(name, "prefill", 0) for name in self.prefill_names[1:]]
        for name, role, core in (("prefill", "prefill", 0), ("decode", "decode", 1),
                                 *extra_prefills):
            extra, env = self._role_config(role)  # type: ignore[arg-type]
            env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
            num_blocks = spec.offload_num_blocks if role == "prefill" else spec.decode_num_blocks
            if num_blocks is not None:
                extra += _small_kv(num_blocks)
            tp = spec.decode_tp if role == "decode" else spec.prefill_tp
            extra += parallel_args(tp, spec.async_scheduling)
            if tp > 1:
                env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(core, tp)
                env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(TP_EXECUTE_MODEL_TIMEOUT_S)
            # The fault goes on decode, and on prefill too when prefill loads from offload.
            fault = role == "decode" or role in spec.roles_with_offload
            servers[name] = self._server(name, core, extra, env,
                                         routed_experts=spec.routed_experts, fault=fault)
        if self.has_prefill_twin:
            servers["twin"] = self._prefill_twin()
        if spec.reference and not spec.reference_first:
            servers["reference"] = self._reference_server()
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

    def _prefill_twin(self) -> VllmServer:
        """A prefill-role server with routed experts off and the rows-transfer switch
        off; the harness sends it what the proxy sends prefill (max_tokens 1)."""
        extra, env = self._role_config("prefill", routed_experts_transfer=False)
        extra = with_store_cache_prefix(extra, TWIN_CACHE_PREFIX)
        env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
        if self.spec.offload_num_blocks is not None:
            extra += _small_kv(self.spec.offload_num_blocks)
        return self._server("twin", 1, extra, env, routed_experts=False)

    def _colocated_servers(self) -> dict[str, VllmServer]:
        spec = self.spec
        assert spec.roles_with_offload, "a colocated deployment tests an offload connector"
        extra, env = self._role_config("colocated")
        # The twin serves without routed experts, so without the rows-transfer switch.
        twin_extra, twin_env = self._role_config("colocated", routed_experts_transfer=False)
        if spec.offload_num_blocks is not None:
            extra += _small_kv(spec.offload_num_blocks)
            twin_extra += _small_kv(spec.offload_num_blocks)
        servers = {
            "subject": self._server("subject", 1, extra, env, fault=True),
            "twin": self._server("twin", 0, twin_extra, twin_env, routed_experts=False),
        }
        if not spec.reference_first:
            servers["reference"] = self._reference_server()
        return servers

    @property
    def url(self) -> str:
        """Where scenario requests go: the proxy (P/D) or the subject (colocated)."""
        if self.spec.topology == "colocated":
            return self.servers["subject"].url
        return self.proxy_url

    def start(self) -> float:
        """Start the deployment; return the seconds it took. A deployment that does
        not come up in time (a server without /health after SERVER_READY_TIMEOUT_S,
        a front without /health after 60 s, or a first P/D request without an
        answer) is stopped and started once more on fresh ports: what the host's
        threads were doing goes to stalls.log and the servers' logs to attempt-1/
        first. A server that exits, or a second timeout, fails the start."""
        begin = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start_once()
                return time.monotonic() - begin
            except TimeoutError as exc:
                self._record_start_stall(attempt, exc)
                self.stop()
                if attempt == START_ATTEMPTS:
                    raise
                self._keep_attempt_logs(attempt)
                self.restarts += 1
                self.proxy_process, self.proxy_port = None, free_port()
                print(f"e2e:   deployment did not come up ({str(exc).splitlines()[0]}); "
                      f"stopped it, logs in {self.logs / f'attempt-{attempt}'}; "
                      "starting it once more", flush=True)
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _start_once(self) -> None:
        if self.only_reference:
            self.servers = {"reference": self._reference_server()}
            self.servers["reference"].start()
            self.servers["reference"].wait_ready(timeout=SERVER_READY_TIMEOUT_S)
            return
        if self.spec.uses_mooncake:
            self.master = MooncakeMaster(self.logs)
            self.master.start()
        for tp in {self.spec.prefill_tp, self.spec.decode_tp}:
            warm_tp_compile(self.spec.model, tp)
        self.servers = (self._colocated_servers() if self.spec.topology == "colocated"
                        else self._pd_servers())
        for server in self.servers.values():
            server.start()
        for server in self.servers.values():
            server.wait_ready(timeout=SERVER_READY_TIMEOUT_S)
        if self.spec.topology == "pd":
            self._deprioritise_spinners()
            self._start_proxy()
            if not self.spec.roles_with_offload and not self.spec.fault:
                self._first_handshakes()

    def _record_start_stall(self, attempt: int, exc: TimeoutError) -> None:
        """While the servers still run: what every thread on the host does
        (tools/testbed/stalls.py) and each server's last log lines, into stalls.log."""
        report = stall_report(self.process_owners())
        tails = "\n".join(f"--- {name}.log (last lines)\n{server.log_tail(12)}"
                          for name, server in self.servers.items())
        entry = (f"{time.strftime('%H:%M:%S')} start attempt {attempt} timed out: "
                 f"{str(exc).splitlines()[0]}\n{report}\n{tails}\n")
        with (self.logs / STALLS_LOG).open("a") as log:
            log.write(entry)
        # Printed too: a CI run shows a failed test's output, not its files.
        print(f"e2e:   {entry}e2e:   (kept in {self.logs / STALLS_LOG})", flush=True)

    def _keep_attempt_logs(self, attempt: int) -> None:
        """Move the servers', the front's and the master's logs aside before the
        next attempt reuses their names (stalls.log and the harness's requests.log
        stay: they are appended to)."""
        kept = self.logs / f"attempt-{attempt}"
        kept.mkdir(exist_ok=True)
        for path in self.logs.glob("*.log"):
            if path.name not in (STALLS_LOG, REQUESTS_LOG):
                path.rename(kept / path.name)

    def _deprioritise_spinners(self) -> None:
        """Nice 19 for every thread busy while the just-started deployment serves
        nothing (NIXL's progress threads): tools/testbed/spinners.py says why."""
        owner = {pid: name for pid, name in self.process_owners().items()
                 if name != "front"}
        threads = spinning_threads(owner)
        deprioritise(threads, self.spec.spinner_nice)
        found = ", ".join(f"{owner[t.pid]} {t.tid} ({t.busy:.2f} CPU s/s)" for t in threads)
        print(f"e2e:   nice {self.spec.spinner_nice} for {len(threads)} thread(s) busy while the "
              f"deployment is idle{': ' + found if found else ''}", flush=True)

    def process_owners(self) -> dict[int, str]:
        """Every live process of the deployment: pid -> server name ("front" for
        the router or proxy)."""
        owner = {pid: name for name, server in self.servers.items()
                 if server.process is not None
                 for pid in process_tree(server.process.pid)}
        if self.proxy_process is not None:
            owner.update({pid: "front" for pid in process_tree(self.proxy_process.pid)})
        return owner

    def _first_handshakes(self) -> None:
        """One one-block P/D request per prefill instance through the front end,
        before any scenario, so that decode's first NIXL handshake with a prefill
        is not part of a checked request. vLLM waits 5 s for the handshake's answer
        (nixl/base_worker.py, RCVTIMEO 5000, not configurable); on this 2-core VM
        that expired on 2 of 7 deployments' first P/D request (2026-12-03), and the
        next handshake succeeded a second later. Best effort: an outcome other than
        200 is printed and the scenarios handshake again; a request that gets no
        answer at all is a deployment that did not come up (TimeoutError).
        Deployments with offload get none (a warm-up block would change what their
        small KV caches evict),
        nor do runs with a planted fault (whose counts it would add to)."""
        for index, _ in enumerate(self.prefill_names):
            body = {"model": "tiny", "prompt": prompt_ids(997, index, BLOCK_SIZE + 1),
                    "max_tokens": 1, "temperature": 0}
            start = time.monotonic()
            timeout = first_request_timeout(self.spec.prefill_tp, self.spec.decode_tp)
            try:
                code, answer = post_json(self.proxy_url, "/v1/completions", body,
                                         timeout=timeout)
            except (TimeoutError, urllib.error.URLError) as exc:
                raise TimeoutError(
                    f"first P/D request {index + 1} (NIXL handshake) got no answer in "
                    f"{timeout:.0f} s: {exc}") from exc
            outcome = "ok" if code == 200 else f"HTTP {code}: {str(answer)[:200]}"
            print(f"e2e:   first P/D request (NIXL handshake) {index + 1}: {outcome} "
                  f"in {time.monotonic() - start:.0f} s", flush=True)

    def _start_proxy(self) -> None:
        self.proxy_process = self.start_front_end(self.spec.router, self.proxy_port, "proxy")

    def start_front_end(self, router: str, port: int, name: str) -> subprocess.Popen[bytes]:
        """Start `router` ("pdproxy" or "vllm-router") in front of this P/D pair on
        `port`, logging to `name`.log; return once its /health answers."""
        log_path = self.logs / f"{name}.log"
        log = log_path.open("wb")
        # Both take one --prefill per prefill instance.
        prefills = [arg for server in self.prefill_names
                    for arg in ("--prefill", self.servers[server].url)]
        decode = self.servers["decode"].url
        if router == "vllm-router":
            command = [router_executable(), "--vllm-pd-disaggregation", "--host", "127.0.0.1",
                       "--port", str(port), *prefills, "--decode", decode,
                       "--kv-connector", "nixl",
                       *ROUTER_HEALTH_ARGS,
                       # Its metrics listener defaults to the fixed port 29000, which a
                       # router left over from an interrupted run would hold.
                       "--prometheus-port", str(free_port())]
        else:
            command = [proxy_executable(), "--port", str(port), "--overlap", self.spec.overlap,
                       *prefills, "--decode", decode]
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                            timeout=10) as resp:
                    if resp.status == 200:
                        return process
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if process.poll() is not None:
                raise RuntimeError(f"{router} exited; log {log_path}")
            time.sleep(0.5)
        stop_process_group(process)
        raise TimeoutError(f"{router} not healthy; log {log_path}")

    def stop(self) -> None:
        """Stop the front, every server and the master. Raises ProcessOutlivedKill
        naming each process that outlived its SIGKILL, after stopping the rest."""
        # Every process gets its stop even when an earlier one fails to die: a server
        # left running would take the machine's cores from whatever runs next.
        failures: list[str] = []
        if self.proxy_process is not None:
            # aiohttp drains in-flight requests first: one hung on a failed decode
            # (a fault run) would hold it for a minute.
            try:
                stop_process_group(self.proxy_process)
            except ProcessOutlivedKill as exc:
                failures.append(f"front: {exc}")
        for name, server in self.servers.items():
            try:
                server.stop()
            except ProcessOutlivedKill as exc:
                failures.append(f"{name}: {exc}")
        if self.master is not None:
            self.master.stop()
        if failures:
            raise ProcessOutlivedKill("; ".join(failures))

    def overlap_flips(self) -> int:
        """Rows at P - 1 where decode's recompute differed from prefill (proxy /health)."""
        try:
            with urllib.request.urlopen(f"{self.proxy_url}/health", timeout=30) as resp:
                return int(json.loads(resp.read())["overlap_rows_differing"])
        except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, ValueError):
            return -1

    @property
    def _loading_servers(self) -> tuple[str, ...]:
        """The servers that check the rows they load: decode (pulled blocks), the
        colocated subject and prefill (offloaded chunks)."""
        return ("decode", "subject", *self.prefill_names)

    def rows_check_failures(self) -> int:
        """Pulled or offloaded blocks whose routed-experts rows failed the check of a
        server under test (decode, the colocated subject or prefill; their logs)."""
        return sum(self.log_count(name, "failed their check")
                   for name in self._loading_servers)

    def recovered_loads(self) -> int:
        """KV load failures the servers under test recovered from by recomputing."""
        return sum(self.log_count(name, "Recovered from KV load failure")
                   for name in self._loading_servers)

    def expired_leases(self) -> int:
        """KV leases the prefill server let run out before decode read the blocks (its log)."""
        return sum(self.log_count(name, "Releasing expired KV blocks")
                   for name in self.prefill_names)

    def metric(self, server: str, name: str) -> int:
        """A Prometheus counter of one server, summed over labels; -1 if unreachable."""
        if server not in self.servers:
            return 0
        total = self.gauge(server, name)
        return -1 if total is None else int(total)

    def gauge(self, server: str, name: str) -> float | None:
        """A Prometheus metric of one server as a float, the series named exactly
        `name` (a selector: it may pin labels) summed over their labels (a gauge such
        as vllm:kv_cache_usage_perc is a fraction); None if unreachable."""
        try:
            return read_total(self.servers[server].url, name)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None

    def decode_preemptions(self) -> int:
        """vLLM's preemption counter on the decode server."""
        return self.metric("decode", "vllm:num_preemptions_total")

    def log_count(self, server: str, needle: str) -> int:
        log = self.logs / f"{server}.log"
        if server not in self.servers or not log.exists():
            return 0
        with log.open(errors="replace") as lines:
            return sum(needle in line for line in lines)

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
