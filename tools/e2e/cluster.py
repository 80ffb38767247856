"""The deployments the equivalence harness drives, all real processes on 127.0.0.1.

P/D (topology "pd"):
- prefill: `vllm serve` with a NixlConnector kv_producer (host buffers, UCX over TCP),
  optionally chained with a KV-offload connector (MultiConnector [NIXL, offload]) and
  a small KV cache, so later turns reload earlier ones from offload;
- decode: the same with kv_consumer; optionally a tiny KV cache to force preemption;
- proxy: tools/pdproxy.
Colocated with offload (topology "colocated"):
- subject: one `vllm serve` with a KV-offload connector and a small KV cache;
- twin: the same server with routed experts off, whose loads nothing limits (the
  "withheld by the clamp" count is the twin's loaded tokens minus the subject's).
Both have a reference: a colocated `vllm serve` with the same model, routed experts on,
no connector and a KV cache large enough that nothing is evicted.
The server under test (decode, or the colocated subject; prefill too with offload)
can carry a planted fault (E2E_FAULT, see faults/sitecustomize.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TOOLS))

from cpu_server import VllmServer, cpu_env, free_port  # noqa: E402
from mooncake_master import MooncakeMaster  # noqa: E402
from scenarios import BLOCK_SIZE  # noqa: E402

FAULTS_DIR = Path(__file__).resolve().parent / "faults"
# A 32-token KV block (the CPU default is 128; CPU attention needs a multiple of 32)
# puts block boundaries within reach of short prompts; float32 keeps near-tie expert
# choices from flipping between runs.
COMMON_ARGS = ("--enable-return-routed-experts", "--dtype", "float32",
               "--block-size", str(BLOCK_SIZE))


# NIXL's prefill side frees a request's blocks when its lease (30 s by default)
# runs out before the decode side has read them. A decode instance with a tiny
# KV cache on a 2-core CPU can keep requests waiting longer than that, and
# vLLM 0.31.0 then reads the freed, reused blocks and decodes from the wrong KV
# (prefill logs "Releasing expired KV blocks"; see docs/r3-pd.md). The harness
# tests routing rows, not lease expiry, so it gives the lease ample room.
KV_LEASE_SECONDS = 900


def _nixl(role: str) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_SECONDS}}


def native_offload(cpu_bytes: int = 1 << 26) -> dict[str, Any]:
    """vLLM's OffloadingConnector with a CPU tier of `cpu_bytes`."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}


def mooncake_store(**extra: Any) -> dict[str, Any]:
    """vLLM's MooncakeStoreConnector (store settings: the role's MOONCAKE_CONFIG_PATH)."""
    return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def _chain(*connectors: dict[str, Any]) -> str:
    """One connector bare, several in a MultiConnector (in this order)."""
    if len(connectors) == 1:
        return json.dumps(connectors[0])
    return json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"connectors": list(connectors)}})


def _small_kv(num_blocks: int) -> tuple[str, ...]:
    # The KV cache must still hold one max-length request (one block is reserved).
    return ("--num-gpu-blocks-override", str(num_blocks),
            "--max-model-len", str((num_blocks - 1) * BLOCK_SIZE))


@dataclass
class ClusterSpec:
    model: Path
    topology: str = "pd"  # "pd" or "colocated"
    decode_num_blocks: int | None = None  # --num-gpu-blocks-override on decode
    fault: str | None = None  # planted on the server(s) under test
    # The harness checks rows against colocated serving, so at P - 1 (computed by
    # both instances) it keeps prefill's row, as colocated does, and counts flips.
    overlap: str = "prefill"
    # KV offload: the connector config, on prefill ("pd") or on the subject ("colocated").
    offload: dict[str, Any] | None = None
    offload_num_blocks: int | None = None  # the small KV cache beside the offload tier
    # P/D only: a connector chained after NIXL on decode (Mooncake with save_decode_cache).
    decode_offload: dict[str, Any] | None = None
    # Start a Mooncake master; prefill contributes 256 MB to the store, decode 0 bytes.
    mooncake: bool = False


@dataclass
class Cluster:
    spec: ClusterSpec
    logs: Path
    servers: dict[str, VllmServer] = field(default_factory=dict)
    proxy_process: subprocess.Popen[bytes] | None = None
    proxy_port: int = field(default_factory=free_port)
    master: MooncakeMaster | None = None

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def _server(self, name: str, core: int, extra: tuple[str, ...],
                env_extra: dict[str, str], routed_experts: bool = True,
                fault: bool = False) -> VllmServer:
        env = cpu_env(opt_in=True, core=core)
        env.update(env_extra)
        if fault and self.spec.fault:
            env["E2E_FAULT"] = self.spec.fault
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(FAULTS_DIR), os.environ.get("PYTHONPATH")]))
        args = COMMON_ARGS if routed_experts else tuple(
            a for a in COMMON_ARGS if a != "--enable-return-routed-experts")
        return VllmServer(model=self.spec.model, log_path=self.logs / f"{name}.log",
                          extra_args=args + extra, env=env)

    def _pd_servers(self) -> dict[str, VllmServer]:
        spec = self.spec
        prefill_chain = [_nixl("kv_producer")] + ([spec.offload] if spec.offload else [])
        prefill_extra = ("--kv-transfer-config", _chain(*prefill_chain))
        if spec.offload_num_blocks is not None:
            prefill_extra += _small_kv(spec.offload_num_blocks)
        decode_chain = [_nixl("kv_consumer")] + ([spec.decode_offload]
                                                 if spec.decode_offload else [])
        decode_extra: tuple[str, ...] = ("--kv-transfer-config", _chain(*decode_chain))
        if spec.decode_num_blocks is not None:
            decode_extra += _small_kv(spec.decode_num_blocks)

        def role_env(role: str, segment: str) -> dict[str, str]:
            env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                   "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            if self.master is not None:
                env["MOONCAKE_CONFIG_PATH"] = str(self.master.client_config(role, segment))
            return env
        return {
            "prefill": self._server("prefill", 0, prefill_extra, role_env("prefill", "256MB"),
                                    fault=spec.offload is not None),
            "decode": self._server("decode", 1, decode_extra, role_env("decode", "0"),
                                   fault=True),
            "reference": self._server("reference", 0, (), {}),
        }

    def _colocated_servers(self) -> dict[str, VllmServer]:
        spec = self.spec
        assert spec.offload is not None, "a colocated deployment tests an offload connector"
        extra = ("--kv-transfer-config", _chain(spec.offload))
        if spec.offload_num_blocks is not None:
            extra += _small_kv(spec.offload_num_blocks)
        return {
            "subject": self._server("subject", 1, extra, {}, fault=True),
            "twin": self._server("twin", 0, extra, {}, routed_experts=False),
            "reference": self._server("reference", 0, (), {}),
        }

    @property
    def url(self) -> str:
        """Where scenario requests go: the proxy (P/D) or the subject (colocated)."""
        if self.spec.topology == "colocated":
            return self.servers["subject"].url
        return self.proxy_url

    def start(self) -> float:
        start = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        if self.spec.mooncake:
            self.master = MooncakeMaster(self.logs)
            self.master.start()
        self.servers = (self._colocated_servers() if self.spec.topology == "colocated"
                        else self._pd_servers())
        try:
            for server in self.servers.values():
                server.start()
            for server in self.servers.values():
                server.wait_ready(timeout=600)
            if self.spec.topology == "pd":
                self._start_proxy()
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - start

    def _start_proxy(self) -> None:
        log = (self.logs / "proxy.log").open("wb")
        self.proxy_process = subprocess.Popen(
            [sys.executable, str(TOOLS / "pdproxy"), "--port", str(self.proxy_port),
             "--overlap", self.spec.overlap,
             "--prefill", self.servers["prefill"].url, "--decode", self.servers["decode"].url],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.proxy_url}/health", timeout=10) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if self.proxy_process.poll() is not None:
                raise RuntimeError(f"proxy exited; log {self.logs / 'proxy.log'}")
            time.sleep(0.5)
        raise TimeoutError(f"proxy not healthy; log {self.logs / 'proxy.log'}")

    def stop(self) -> None:
        if self.proxy_process is not None and self.proxy_process.poll() is None:
            os.killpg(self.proxy_process.pid, signal.SIGTERM)
            self.proxy_process.wait(timeout=30)
        for server in self.servers.values():
            server.stop()
        if self.master is not None:
            self.master.stop()

    def overlap_flips(self) -> int:
        """Rows at P - 1 where decode's recompute differed from prefill (proxy /health)."""
        try:
            with urllib.request.urlopen(f"{self.proxy_url}/health", timeout=30) as resp:
                return int(json.loads(resp.read())["overlap_rows_differing"])
        except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, ValueError):
            return -1

    def expired_leases(self) -> int:
        """KV leases the prefill server let run out before decode read the blocks (its log)."""
        return self.log_count("prefill", "Releasing expired KV blocks")

    def metric(self, server: str, name: str) -> int:
        """A Prometheus counter of one server, summed over labels; -1 if unreachable."""
        if server not in self.servers:
            return 0
        try:
            with urllib.request.urlopen(f"{self.servers[server].url}/metrics",
                                        timeout=10) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return -1
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

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
