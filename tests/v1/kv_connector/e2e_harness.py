"""Run the CPU equivalence harness (`python -m tools.e2e --reduced`) from a test.

The harness starts vLLM servers, a proxy and sometimes a Mooncake master as its
children. It runs in a session of its own, so a run that overstays its timeout is
stopped with every process it started (SIGKILL to the session's process group)
instead of leaving servers behind that take the machine's cores from later tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 1100


def run_harness(workdir: Path, *args: str, timeout: float = TIMEOUT_S) -> tuple[int, str]:
    """The harness's exit code and its stdout + stderr."""
    command = [sys.executable, "-m", "tools.e2e", "--reduced", "--workdir", str(workdir)]
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
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise AssertionError(
                f"the harness ran past {timeout:.0f} s and was stopped with every "
                f"process it started; its output ended:\n{output[-3000:]}"
            ) from None
    return proc.returncode, output
