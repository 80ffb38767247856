"""The negative control of tests/v1/kv_connector/unit/test_mooncake_store_load_failure_retry.py
(patch `end-store-lookups-before-chunks-whose-load-failed`), in a separate run.

Those tests run again in a new pytest process with the fix planted away
(E2E_FAULT=uncapped-store-lookups, tools/e2e/faults/sitecustomize.py: the store's
lookups no longer end before chunks whose load failed, as in stock vLLM). Every
one of those tests asserts where a lookup ends, so each must fail.
"""

from __future__ import annotations

import pytest

from tools.testbed.faulted_pytest import run_under_fault

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_control]

RETRY_TESTS = "tests/v1/kv_connector/unit/test_mooncake_store_load_failure_retry.py"


def test_the_retry_tests_fail_when_lookups_are_not_capped() -> None:
    run = run_under_fault("uncapped-store-lookups", RETRY_TESTS)
    assert run.returncode == 1, run.output
    assert run.failed == [
        "test_a_remembered_chunk_expires_and_the_memory_is_bounded",
        "test_a_request_whose_first_chunk_fails_is_recomputed_and_finishes",
        "test_a_request_whose_whole_load_failed_computes_from_its_load_start",
        "test_another_request_stops_at_the_failed_chunk",
    ], run.output
    assert "passed" not in run.output.splitlines()[-1], run.output
