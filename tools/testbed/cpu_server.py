"""Run `vllm serve` on CPU for the end-to-end tests, the harness and the demo.

A test fixture (`from tools.testbed.cpu_server import VllmServer`). `choice_rows`
reads a response choice's routed-experts rows through the fork's client decoder
(`vllm.entrypoints.routed_experts`). `npy_rows` is the one exception: the end-to-end
tests shipped with the upstream PRs that come before the client decoder's PR
(`routed-experts-client-decoder` in patches/prs.toml) cannot import it.

`VllmServer` starts the real `vllm` console script of the current environment,
waits for `/health`, and always stops the process group on exit. The server's
log goes to a file; on a failed start the error names the log and quotes its
tail, so a test failure says why the server did not come up.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

# The opt-in that lets Model Runner V2, and with it routed-experts capture, run
# on CPU through Triton's interpreter (patches/0001).
OPT_IN = {"VLLM_CPU_TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}


def cpu_env(opt_in: bool = True, core: int | None = None) -> dict[str, str]:
    """The environment a CPU `vllm serve` needs here: small KV cache, loopback,
    offline."""
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_CI_ENV": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
        }
    )
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    for key in OPT_IN:
        env.pop(key, None)
    if opt_in:
        env.update(OPT_IN)
    return env


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range (where binding port 0 lands)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


# Ports handed out below the ephemeral range: a random start per process, then one
# after another, so one process never hands out the same port twice.
_PORT_SPAN = 8000
_next_port: list[int] = []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, below the ephemeral range.

    A port from that range (what binding port 0 returns) is also what every outgoing
    connection and every server's own port-0 bind draws from, so it can be taken
    before the server it was given to binds it: a prefill's NIXL side channel once
    failed with "Address already in use" and the server never became ready."""
    low, _ = _ephemeral_ports()
    floor = max(1024, low - _PORT_SPAN)
    if low - floor < 100:  # no room below the range: fall back to the kernel's pick
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    if not _next_port:
        _next_port.append(random.randrange(floor, low))
    for _ in range(low - floor):
        port = _next_port[0]
        _next_port[0] = floor + (port + 1 - floor) % (low - floor)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port on 127.0.0.1 in [{floor}, {low})")


def vllm_executable() -> str:
    candidate = Path(sys.executable).parent / "vllm"
    return str(candidate) if candidate.exists() else "vllm"


# How long a process may take to go after SIGKILL. Exit frees the whole address
# space (a server's KV cache is gigabytes); on a 2-core host busy with other
# engines that has taken more than 30 s.
KILL_WAIT_S = 180.0


class ProcessOutlivedKill(RuntimeError):
    """A process still alive `KILL_WAIT_S` after SIGKILL: it holds its memory and
    maybe cores, so whatever runs next on the host is not measured alone."""


def kernel_state(pid: int) -> str:
    """What a process is doing in the kernel: its state and wait channel."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
    except OSError:
        wchan = "unreadable"
    return f"state {status}, wchan {wchan}"


def stop_process_group(
    process: subprocess.Popen, grace: float = 30.0, kill_wait: float = KILL_WAIT_S
) -> None:
    """SIGTERM a process that leads its own process group (started with
    start_new_session or process_group=0), SIGKILL it after `grace`
    seconds (a server still waiting on a hung request ignores the first), and then
    every descendant still alive: an engine core or worker outside the group would
    otherwise outlive a killed server and take the cores of whatever runs next.
    Raises ProcessOutlivedKill, naming the process's kernel state, if it is still
    alive `kill_wait` seconds after SIGKILL; the descendants are killed first."""
    if process.poll() is not None:
        return
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=kill_wait)
        except subprocess.TimeoutExpired:
            raise ProcessOutlivedKill(
                f"process {process.pid} still alive {kill_wait:.0f} s after SIGKILL "
                f"({kernel_state(process.pid)})"
            ) from None
    finally:
        _, alive = psutil.wait_procs(descendants, timeout=grace)
        for child in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


@dataclass
class VllmServer:
    model: Path
    log_path: Path
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=cpu_env)
    served_name: str = "tiny"
    enforce_eager: bool = True  # CPU runs are eager; a GPU run may capture graphs
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            vllm_executable(),
            "serve",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            self.served_name,
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "512",
            *(("--enforce-eager",) if self.enforce_eager else ()),
            *self.extra_args,
        ]

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            # A process group of its own (stopped as one), in the caller's session: the
            # kernel shares CPU equally between sessions (autogroup) before it looks at
            # a thread's nice value, so a server in a session of its own would keep
            # its full share for threads the harness set to nice 19 (spinners.py).
            process_group=0,
        )
        log.close()

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Block until /health answers; return the seconds it took."""
        assert self.process is not None, "start() first"
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with code {self.process.returncode} before "
                    f"it was ready; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(
            f"vllm serve not ready after {timeout:.0f} s; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def wait_exit(self, timeout: float = 300.0) -> int:
        assert self.process is not None, "start() first"
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(
                self.log_path.read_text(errors="replace").splitlines()[-lines:]
            )
        except FileNotFoundError:
            return "(no log)"

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def complete(self, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        """POST /v1/completions; an HTTP error raises with the server's message."""
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(
                f"HTTP {exc.code} from {self.url}: {exc.read().decode()}"
            ) from None


def post_json(
    url: str, path: str, body: dict[str, Any], timeout: float = 300.0
) -> tuple[int, dict[str, Any]]:
    """POST a JSON body; the HTTP status and the JSON answer, errors included."""
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        text = exc.read()
        try:
            return exc.code, json.loads(text or b"{}")
        except json.JSONDecodeError:  # e.g. a router's plain-text 404
            return exc.code, {"error": {"message": text.decode(errors="replace")}}


def post_stream(
    url: str, path: str, body: dict[str, Any], timeout: float = 300.0
) -> list[dict[str, Any]]:
    """POST a streaming request; the chunks of its server-sent events, in order."""
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body | {"stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    chunks = []
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def final_chunk_rows(chunks: list[dict[str, Any]]) -> dict[int, np.ndarray | None]:
    """Each choice's rows from its final (finish_reason) chunk, by choice index;
    fails if an earlier chunk carries rows, or a start comes without rows. A stream
    chunk's `token_ids` are its own tokens only, so the rows are decoded without the
    token-count check (raises RoutedExpertsError for rows the decoder refuses)."""
    rows: dict[int, np.ndarray | None] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            payload = choice.get("routed_experts")
            if choice.get("finish_reason") is None:
                assert payload is None, "rows on a chunk before the final one"
                continue
            assert (payload is None) == (choice.get("routed_experts_start") is None)
            rows[choice["index"]] = choice_rows(choice, check_token_counts=False)
    return rows


def final_chunk_starts(chunks: list[dict[str, Any]]) -> dict[int, int | None]:
    """Each choice's routed_experts_start from its final (finish_reason) chunk."""
    return {
        choice["index"]: choice.get("routed_experts_start")
        for chunk in chunks
        for choice in chunk["choices"]
        if choice.get("finish_reason") is not None
    }


ROWS_FIELDS = ("routed_experts", "routed_experts_start")


def choice_rows(
    choice: Mapping[str, Any],
    *,
    check_token_counts: bool = True,
    response: Mapping[str, Any] | None = None,
) -> np.ndarray | None:
    """A response choice's routed-experts rows, or None when it carries none.

    Decoded only by the fork's client decoder (`vllm.entrypoints.routed_experts`),
    which raises RoutedExpertsError for rows it cannot validate. With
    `check_token_counts`, a choice with `prompt_token_ids` and `token_ids` must hold
    one row per position from its start to P + C - 1; pass False where those fields
    do not describe the whole request (a stream chunk). A chat choice has no
    `prompt_token_ids` (its response does): pass the `response` to count its rows."""
    if choice.get("routed_experts") is None:
        return None
    # Imported here: this module ships with PRs that come before the decoder's.
    from vllm.entrypoints.routed_experts import decode_routed_experts

    if not check_token_counts:
        choice = {key: choice[key] for key in ROWS_FIELDS if key in choice}
        response = None
    prompt = None if response is None else response.get("prompt_token_ids")
    return decode_routed_experts(choice, prompt_token_ids=prompt).rows


def npy_rows(payload: str) -> np.ndarray:
    """A routed_experts payload (base64 of a `.npy` array) as numpy reads it, with no
    check of its own. Only for the tests shipped with PRs that come before the client
    decoder's (they run on upstream without it); everything else uses choice_rows."""
    return np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
