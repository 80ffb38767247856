"""Run the CPU equivalence harness (`python -m tools.e2e --reduced`, or another of its
entry points) from a test.

The harness starts vLLM servers, a proxy and sometimes a Mooncake master as its
children, each in a session of its own. A run that overstays its timeout gets
SIGTERM, on which the harness stops its cluster (SIGKILL after a grace period);
after STOP_GRACE_S its own process group is killed too. No server is left behind
to take the machine's cores from later tests.

A test that runs the harness takes its pytest timeout from `pytest_timeout()`: it
outlasts the harness's timeout and the stop, so that an overstaying run fails with
the harness's own output (where it was, what it waited on) rather than with
pytest-timeout's stack of the waiting test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 1100
STOP_GRACE_S = 240  # the harness's cluster.stop(): every server's grace, then SIGKILL
# What a test needs beyond the harness's run and stop: pytest's own setup, reading logs.
TEST_SLACK_S = 60


def pytest_timeout(harness_timeout: float = TIMEOUT_S) -> pytest.MarkDecorator:
    """The pytest timeout of a test whose harness run may take `harness_timeout`."""
    return pytest.mark.timeout(harness_timeout + STOP_GRACE_S + TEST_SLACK_S)


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
