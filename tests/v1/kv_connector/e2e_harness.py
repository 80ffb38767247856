"""Run the CPU equivalence harness (`python -m tools.e2e --reduced`, or another of its
entry points) from a test.

The harness starts vLLM servers, a proxy and sometimes a Mooncake master as its
children, each in a session of its own. A run that overstays its timeout gets
SIGTERM, on which the harness stops its cluster (SIGKILL after a grace period);
after STOP_GRACE_S its own process group is killed too. No server is left behind
to take the machine's cores from later tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 1100
STOP_GRACE_S = 240  # the harness's cluster.stop(): every server's grace, then SIGKILL


def run_harness(workdir: Path, *args: str, timeout: float = TIMEOUT_S) -> tuple[int, str]:
    """The harness's exit code and its stdout + stderr."""
    return run_module("tools.e2e", "--reduced", "--workdir", str(workdir), *args,
                      timeout=timeout)


def run_module(module: str, *args: str, timeout: float = TIMEOUT_S) -> tuple[int, str]:
    """`python -m module args` from the repository root (a harness entry point):
    its exit code and its stdout + stderr."""
    command = [sys.executable, "-m", module]
    with subprocess.Popen(
        [*command, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                output, _ = proc.communicate(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
            raise AssertionError(
                f"the harness ran past {timeout:.0f} s and was stopped with every "
                f"process it started; its output ended:\n{output[-3000:]}"
            ) from None
    return proc.returncode, output
