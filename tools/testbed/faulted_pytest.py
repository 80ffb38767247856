"""Run pytest on some tests again, in a process of its own, with a fault planted
(named by E2E_FAULT, patched in by tools/e2e/faults/sitecustomize.py; the faults
are listed in tools/e2e/fault_registry.py, those of mode pytest-control for here):
the negative controls of unit tests use it to show those tests fail without the fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAULTS_DIR = ROOT / "tools" / "e2e" / "faults"


@dataclass(frozen=True)
class FaultedRun:
    returncode: int
    failed: list[str]  # names of the failed test functions, sorted, once each
    output: str  # the tail of stdout and stderr, for assertion messages


def run_under_fault(fault: str, *nodeids: str, timeout: float = 1800) -> FaultedRun:
    """pytest on `nodeids` (paths or node ids from the repository root) with
    E2E_FAULT=`fault`."""
    env = dict(os.environ, E2E_FAULT=fault)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(FAULTS_DIR), env.get("PYTHONPATH")) if p
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rf",
            "-p",
            "no:cacheprovider",
            *nodeids,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    failed = sorted(set(re.findall(r"^FAILED \S+::(\w+)", run.stdout, re.M)))
    return FaultedRun(run.returncode, failed, (run.stdout + run.stderr)[-3000:])
