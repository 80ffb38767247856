"""The deployment the equivalence harness drives: 1P1D over NIXL, the proxy, and a
colocated reference, all real processes on 127.0.0.1.

Roles:
- prefill: `vllm serve` with a NixlConnector kv_producer (host buffers, UCX over TCP);
- decode: the same with kv_consumer; optionally a tiny KV cache to force preemption,
  and optionally a planted fault (E2E_FAULT, see faults/sitecustomize.py);
- proxy: tools/pdproxy;
- reference: a colocated `vllm serve` with the same model and settings.
Every server runs with routed experts on, through the CPU opt-in.
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

TOOLS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TOOLS))

from cpu_server import VllmServer, cpu_env, free_port  # noqa: E402
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


def _nixl(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                       "kv_buffer_device": "cpu",
                       "kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_SECONDS}})


@dataclass
class ClusterSpec:
    model: Path
    decode_num_blocks: int | None = None  # --num-gpu-blocks-override on decode
    fault: str | None = None  # planted on the decode server
    # The harness checks rows against colocated serving, so at P - 1 (computed by
    # both instances) it keeps prefill's row, as colocated does, and counts flips.
    overlap: str = "prefill"


@dataclass
class Cluster:
    spec: ClusterSpec
    logs: Path
    servers: dict[str, VllmServer] = field(default_factory=dict)
    proxy_process: subprocess.Popen[bytes] | None = None
    proxy_port: int = field(default_factory=free_port)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def _server(self, name: str, core: int, extra: tuple[str, ...],
                env_extra: dict[str, str]) -> VllmServer:
        env = cpu_env(opt_in=True, core=core)
        env.update(env_extra)
        return VllmServer(model=self.spec.model, log_path=self.logs / f"{name}.log",
                          extra_args=COMMON_ARGS + extra, env=env)

    def start(self) -> float:
        start = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        decode_extra: tuple[str, ...] = ("--kv-transfer-config", _nixl("kv_consumer"))
        if self.spec.decode_num_blocks is not None:
            blocks = self.spec.decode_num_blocks
            # The KV cache must still hold one max-length request (one block is reserved).
            decode_extra += ("--num-gpu-blocks-override", str(blocks),
                             "--max-model-len", str((blocks - 1) * BLOCK_SIZE))
        decode_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                      "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        if self.spec.fault:
            decode_env["E2E_FAULT"] = self.spec.fault
            decode_env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(FAULTS_DIR), os.environ.get("PYTHONPATH")]))
        self.servers = {
            "prefill": self._server("prefill", 0, ("--kv-transfer-config", _nixl("kv_producer")),
                                    {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                                     "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}),
            "decode": self._server("decode", 1, decode_extra, decode_env),
            "reference": self._server("reference", 0, (), {}),
        }
        try:
            for server in self.servers.values():
                server.start()
            for server in self.servers.values():
                server.wait_ready(timeout=600)
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

    def overlap_flips(self) -> int:
        """Rows at P - 1 where decode's recompute differed from prefill (proxy /health)."""
        try:
            with urllib.request.urlopen(f"{self.proxy_url}/health", timeout=30) as resp:
                return int(json.loads(resp.read())["overlap_rows_differing"])
        except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, ValueError):
            return -1

    def expired_leases(self) -> int:
        """KV leases the prefill server let run out before decode read the blocks (its log)."""
        log = self.logs / "prefill.log"
        if not log.exists():
            return 0
        with log.open(errors="replace") as lines:
            return sum("Releasing expired KV blocks" in line for line in lines)

    def decode_preemptions(self) -> int:
        """vLLM's preemption counter on the decode server (Prometheus /metrics)."""
        try:
            with urllib.request.urlopen(f"{self.servers['decode'].url}/metrics", timeout=10) as r:
                text = r.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return -1
        total = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:num_preemptions") and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
