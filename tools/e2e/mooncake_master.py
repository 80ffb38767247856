"""A Mooncake store for the harness: one `mooncake_master` on 127.0.0.1 with its HTTP
metadata server.

vLLM's MooncakeStoreConnector reads its store settings from the JSON file named by
MOONCAKE_CONFIG_PATH. The harness writes each role's file from `vllm
kv-transfer-config`'s builder (role_chains.py), which decides the segment and mode;
this module supplies only where the clients connect (`client()`).
tools/setup-mooncake.sh installs the client and the master.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm.distributed.kv_transfer.role_chains import MooncakeClient

from tools.testbed.cpu_server import free_port, stop_process_group
from tools.testbed.metrics import read, select


def master_executable() -> Path:
    try:
        import mooncake
    except ImportError:
        raise RuntimeError("the Mooncake store is not installed in this venv; run "
                           "tools/setup-mooncake.sh (make e2e does)") from None
    return Path(mooncake.__file__).resolve().parent / "mooncake_master"


CLIENT_TTL_S = 30


@dataclass
class MooncakeMaster:
    workdir: Path
    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = _start_listening(
            [str(master_executable()), f"-rpc_port={self.rpc_port}",
             f"-metrics_port={self.metrics_port}", "-enable_http_metadata_server=true",
             "-http_metadata_server_host=127.0.0.1",
             f"-http_metadata_server_port={self.http_port}", "-default_kv_lease_ttl=5000",
             # Mooncake's default (10 s without a heartbeat) unmounts a live server's
             # segment, and every object in it, on a starved 2-core host.
             f"-client_ttl={CLIENT_TTL_S}"],
            self.workdir / "mooncake_master.log", (self.rpc_port, self.http_port), timeout)

    def client(self) -> MooncakeClient:
        """Where every role's store client connects: this master, over TCP."""
        return MooncakeClient(
            master_server_address=f"127.0.0.1:{self.rpc_port}",
            metadata_server=f"http://127.0.0.1:{self.http_port}/metadata",
            protocol="tcp", device_name="", local_buffer_size="64MB")

    def key_count(self) -> int:
        """How many objects the master knows (its `master_key_count` gauge)."""
        url = f"http://127.0.0.1:{self.metrics_port}"
        found = select(read(url), "master_key_count")
        if not found:
            raise RuntimeError(f"{url}/metrics has no master_key_count")
        return int(sum(found.values()))

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process)


@dataclass
class SegmentHolder:
    """Mooncake's standalone client (`mooncake_client`) holding store memory, so the
    objects outlive the vLLM servers that put them (each server then mounts no memory
    of its own: a 0-byte segment)."""

    master: MooncakeMaster
    segment: str = "256MB"
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        self.process = _start_listening(
            [str(master_executable().with_name("mooncake_client")),
             f"-global_segment_size={self.segment}",
             f"-master_server_address=127.0.0.1:{self.master.rpc_port}",
             f"-metadata_server=http://127.0.0.1:{self.master.http_port}/metadata",
             "-protocol=tcp", "-host=127.0.0.1", f"-port={self.port}"],
            self.master.workdir / "segment_holder.log", (self.port,), timeout)

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process)


def _start_listening(command: list[str], log_path: Path, ports: tuple[int, ...],
                     timeout: float) -> subprocess.Popen[bytes]:
    """Start `command` in its own session, logging to `log_path`, and wait until it
    listens on every port; a process that exits or never listens is an error (and is
    stopped)."""
    name = Path(command[0]).name
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}; log {log_path}")
        if all(_listening(port) for port in ports):
            return process
        time.sleep(0.2)
    stop_process_group(process)
    raise TimeoutError(f"{name} did not listen within {timeout:.0f} s")


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0
