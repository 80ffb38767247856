"""The deployments the equivalence harness drives, all real processes on 127.0.0.1.

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

`Cluster` runs one such deployment: it starts it (retrying a start that stalls),
stops it, and reads it. The parts live beside it, one concern each:

- tools/e2e/cluster_spec.py: what the deployment is (`ClusterSpec`);
- tools/e2e/role_servers.py: each server's command line, environment and chain;
- tools/e2e/fronts.py: the proxy or router in front of P/D;
- tools/e2e/readiness.py: timeouts, warm-up and first handshakes, stall records;
- tools/e2e/readings.py: metrics, leak gauges and log counts.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.testbed.cpu_server import (
    ProcessOutlivedKill,
    VllmServer,
    free_port,
    stop_process_group,
)
from tools.e2e import fronts, readiness, readings
from tools.e2e.cluster_spec import ClusterSpec
from tools.e2e.mooncake_master import MooncakeMaster
from tools.e2e.role_servers import RoleServers


def unwind_on_sigterm() -> None:
    """Make SIGTERM (a test's timeout, CI cancelling) unwind through `Cluster.stop()`:
    the servers run in sessions of their own and would outlive an entry point killed
    outright."""
    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


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

    @property
    def prefill_names(self) -> list[str]:
        """The prefill servers' names: "prefill", then "prefill-1", ... (xPyD)."""
        return self.spec.prefill_names

    @property
    def has_prefill_twin(self) -> bool:
        """Whether the deployment runs a twin prefill (RoleServers.has_prefill_twin)."""
        return RoleServers(self.spec, self.logs).has_prefill_twin

    @property
    def url(self) -> str:
        """Where scenario requests go: the proxy (P/D) or the subject (colocated)."""
        if self.spec.topology == "colocated":
            return self.servers["subject"].url
        return self.proxy_url

    # -- starting and stopping ---------------------------------------------------------

    def start(self) -> float:
        """Start the deployment; return the seconds it took. A deployment that does
        not come up in time (a server without /health after SERVER_READY_TIMEOUT_S,
        a front without /health after 60 s, or a first P/D request without an
        answer) is stopped and started once more on fresh ports: what the host's
        threads were doing goes to stalls.log and the servers' logs to attempt-1/
        first. A server that exits, or a second timeout, fails the start."""
        begin = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, readiness.START_ATTEMPTS + 1):
            try:
                self._start_once()
                return time.monotonic() - begin
            except TimeoutError as exc:
                readiness.record_start_stall(self.logs, attempt, exc,
                                             self.process_owners(), self.servers)
                self.stop()
                if attempt == readiness.START_ATTEMPTS:
                    raise
                kept = readiness.keep_attempt_logs(self.logs, attempt)
                self.restarts += 1
                self.proxy_process, self.proxy_port = None, free_port()
                print(f"e2e:   deployment did not come up ({str(exc).splitlines()[0]}); "
                      f"stopped it, logs in {kept}; starting it once more", flush=True)
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _start_once(self) -> None:
        if self.only_reference:
            self.servers = {"reference": RoleServers(self.spec, self.logs).reference()}
            self.servers["reference"].start()
            self.servers["reference"].wait_ready(timeout=readiness.SERVER_READY_TIMEOUT_S)
            return
        if self.spec.uses_mooncake:
            self.master = MooncakeMaster(self.logs)
            self.master.start()
        for tp in {self.spec.prefill_tp, self.spec.decode_tp}:
            readiness.warm_tp_compile(self.spec.model, tp)
        self.servers = RoleServers(self.spec, self.logs, self.master).servers()
        for server in self.servers.values():
            server.start()
        for server in self.servers.values():
            server.wait_ready(timeout=readiness.SERVER_READY_TIMEOUT_S)
        if self.spec.topology == "pd":
            readiness.deprioritise_spinners(self.process_owners(), self.spec.spinner_nice)
            self.proxy_process = self.start_front_end(self.spec.router, self.proxy_port,
                                                      "proxy")
            if not self.spec.roles_with_offload and not self.spec.fault:
                self._first_handshakes()

    def _first_handshakes(self) -> None:
        """Decode's first NIXL handshake with each prefill, before any scenario
        (readiness.first_handshakes says why and what counts as not coming up)."""
        readiness.first_handshakes(self.proxy_url, len(self.prefill_names),
                                   self.spec.prefill_tp, self.spec.decode_tp)

    def start_front_end(self, router: str, port: int, name: str) -> subprocess.Popen[bytes]:
        """Start `router` ("pdproxy" or "vllm-router") in front of this P/D pair on
        `port`, logging to `name`.log; return once its /health answers."""
        return fronts.start_front(
            router, port, self.logs / f"{name}.log",
            [self.servers[server].url for server in self.prefill_names],
            self.servers["decode"].url, self.spec.overlap)

    def process_owners(self) -> dict[int, str]:
        """Every live process of the deployment: pid -> server name ("front" for
        the router or proxy)."""
        return readiness.process_owners(self.servers, self.proxy_process)

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

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- reading it ---------------------------------------------------------------------

    def overlap_flips(self) -> int:
        """Rows at P - 1 where decode's recompute differed from prefill (proxy /health)."""
        return fronts.overlap_flips(self.proxy_url)

    def rows_check_failures(self) -> int:
        """Pulled or offloaded blocks whose routed-experts rows failed the check of a
        server under test (decode, the colocated subject or prefill; their logs)."""
        return sum(self.log_count(name, readings.ROWS_CHECK_FAILED)
                   for name in readings.loading_servers(self.prefill_names))

    def recovered_loads(self) -> int:
        """KV load failures the servers under test recovered from by recomputing."""
        return sum(self.log_count(name, readings.RECOVERED_LOAD)
                   for name in readings.loading_servers(self.prefill_names))

    def expired_leases(self) -> int:
        """KV leases the prefill server let run out before decode read the blocks (its log)."""
        return sum(self.log_count(name, readings.EXPIRED_LEASE)
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
        return readings.gauge(self.servers, server, name)

    def decode_preemptions(self) -> int:
        """vLLM's preemption counter on the decode server."""
        return self.metric("decode", "vllm:num_preemptions_total")

    def log_count(self, server: str, needle: str) -> int:
        """Lines of `server`'s log that contain `needle` (0 without such a server)."""
        return readings.log_count(self.logs, self.servers, server, needle)
