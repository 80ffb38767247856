"""The negative control of tests/distributed/kv_transfer/test_role_chains.py (patch
`add-vllm-kv-transfer-config-per-role-p-d-connector`), in a separate run.

Its golden comparison and its spelled-out examples run again in a new pytest
process with a fault planted in the builder (E2E_FAULT=reversed-role-chains,
tools/e2e/faults/sitecustomize.py: every chain is printed in reverse order, NIXL
last). Both compare the printed chains, so both must fail.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_control]

ROOT = Path(__file__).resolve().parents[3]
TESTS = "tests/distributed/kv_transfer/test_role_chains.py"


def test_the_golden_and_the_examples_fail_on_reversed_chains() -> None:
    env = dict(os.environ, E2E_FAULT="reversed-role-chains")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "tools/e2e/faults"), env.get("PYTHONPATH")) if p
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
         f"{TESTS}::test_every_combination_matches_its_golden",
         f"{TESTS}::test_examples_from_the_spec"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    output = run.stdout + run.stderr
    failed = sorted(set(re.findall(r"^FAILED \S+::(\w+)", run.stdout, re.M)))
    assert run.returncode == 1, output[-3000:]
    assert failed == [
        "test_every_combination_matches_its_golden",
        "test_examples_from_the_spec",
    ], output[-3000:]
