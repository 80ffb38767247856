"""The negative control of tests/distributed/kv_transfer/test_role_chains.py (patch
`add-vllm-kv-transfer-config-per-role-p-d-connector`), in a separate run.

Its golden comparison and its spelled-out examples run again in a new pytest
process with a fault planted in the builder (E2E_FAULT=reversed-role-chains,
tools/e2e/faults/sitecustomize.py: every chain is printed in reverse order, NIXL
last). Both compare the printed chains, so both must fail.
"""

from __future__ import annotations

import pytest

from tools.testbed.faulted_pytest import run_under_fault

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_control]

TESTS = "tests/distributed/kv_transfer/test_role_chains.py"


def test_the_golden_and_the_examples_fail_on_reversed_chains() -> None:
    run = run_under_fault(
        "reversed-role-chains",
        f"{TESTS}::test_every_combination_matches_its_golden",
        f"{TESTS}::test_examples_from_the_spec",
    )
    assert run.returncode == 1, run.output
    assert run.failed == [
        "test_every_combination_matches_its_golden",
        "test_examples_from_the_spec",
    ], run.output
