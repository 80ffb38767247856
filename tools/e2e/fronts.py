"""What sits in front of a harness P/D deployment: the P/D proxy (`vllm-r3-pdproxy`)
or the `vllm-router` P/D router, started as processes of their own
(`start_front`), and what the proxy reports about the rows it merged
(`overlap_flips`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tools.testbed.cpu_server import free_port, stop_process_group

# vllm-router checks each worker's /health every 60 s with a 5 s timeout and marks it
# unavailable after 3 failed checks; then every request is "503 No available workers".
# On a 2-core machine running three servers a decode's /health measured 32 s and 60 s
# (a CI run and a local rerun, 2026-12-03), so a live decode was dropped in the
# middle of a scenario. A dead server still fails its check at once (connection
# refused); only a slow answer is tolerated.
ROUTER_HEALTH_ARGS = ("--health-check-timeout-secs", "180")
# How long a front may take to answer /health.
FRONT_READY_TIMEOUT_S = 60.0


def _console_script(name: str, install: str) -> str:
    """The console script `name` installed beside this interpreter."""
    script = Path(sys.executable).parent / name
    if not script.is_file():
        raise RuntimeError(f"{script} is missing: {install} (tools/setup-test-env.sh does)")
    return str(script)


def router_executable() -> str:
    """The `vllm-router` P/D router."""
    return _console_script("vllm-router", "pip install vllm-router==0.1.17")


def proxy_executable() -> str:
    """The P/D proxy, `vllm-r3-pdproxy`."""
    return _console_script("vllm-r3-pdproxy", "install the P/D proxy into this "
                           "environment (pip install ./pdproxy)")


def front_command(router: str, port: int, prefill_urls: Sequence[str], decode_url: str,
                  overlap: str) -> list[str]:
    """The command line of `router` ("pdproxy" or "vllm-router") on `port` in front
    of the prefill instances and the decode instance; `overlap`: the proxy's choice
    at P - 1."""
    # Both take one --prefill per prefill instance.
    prefills = [arg for url in prefill_urls for arg in ("--prefill", url)]
    if router == "vllm-router":
        return [router_executable(), "--vllm-pd-disaggregation", "--host", "127.0.0.1",
                "--port", str(port), *prefills, "--decode", decode_url,
                "--kv-connector", "nixl",
                *ROUTER_HEALTH_ARGS,
                # Its metrics listener defaults to the fixed port 29000, which a
                # router left over from an interrupted run would hold.
                "--prometheus-port", str(free_port())]
    return [proxy_executable(), "--port", str(port), "--overlap", overlap,
            *prefills, "--decode", decode_url]


def start_front(router: str, port: int, log_path: Path, prefill_urls: Sequence[str],
                decode_url: str, overlap: str) -> subprocess.Popen[bytes]:
    """Start `router` (`front_command`) in a session of its own, logging to
    `log_path`; return once its /health answers. A front that exits first raises
    RuntimeError, one without /health after FRONT_READY_TIMEOUT_S is stopped and
    raises TimeoutError."""
    command = front_command(router, port, prefill_urls, decode_url, overlap)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + FRONT_READY_TIMEOUT_S
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


def overlap_flips(proxy_url: str) -> int:
    """Rows at P - 1 where decode's recompute differed from prefill (the P/D proxy's
    /health); -1 when it does not answer (or the front is not the proxy)."""
    try:
        with urllib.request.urlopen(f"{proxy_url}/health", timeout=30) as resp:
            return int(json.loads(resp.read())["overlap_rows_differing"])
    except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, ValueError):
        return -1
