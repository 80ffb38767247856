"""The negative control of tests/v1/kv_connector/unit/test_mooncake_store_load_failure_retry.py
(patch `end-store-lookups-before-chunks-whose-load-failed`), in a separate run.

Those tests run again in a new pytest process with the fix planted away
(E2E_FAULT=uncapped-store-lookups, tools/e2e/faults/sitecustomize.py: the store's
lookups no longer end before chunks whose load failed, as in stock vLLM). Every
one of those tests asserts where a lookup ends, so each must fail.
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
RETRY_TESTS = "tests/v1/kv_connector/unit/test_mooncake_store_load_failure_retry.py"


def test_the_retry_tests_fail_when_lookups_are_not_capped() -> None:
    env = dict(os.environ, E2E_FAULT="uncapped-store-lookups")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "tools/e2e/faults"), env.get("PYTHONPATH")) if p
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
         RETRY_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    output = run.stdout + run.stderr
    failed = sorted(set(re.findall(r"^FAILED \S+::(\w+)", run.stdout, re.M)))
    assert run.returncode == 1, output[-3000:]
    assert failed == [
        "test_a_remembered_chunk_expires_and_the_memory_is_bounded",
        "test_a_request_whose_first_chunk_fails_is_recomputed_and_finishes",
        "test_a_request_whose_whole_load_failed_computes_from_its_load_start",
        "test_another_request_stops_at_the_failed_chunk",
    ], output[-3000:]
    assert "passed" not in output.splitlines()[-1], output[-3000:]
