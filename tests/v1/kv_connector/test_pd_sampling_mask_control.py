"""The negative control of tests/v1/kv_connector/test_pd_sampling_mask_e2e.py, in a
separate run.

The same P/D deployment serves again with a fault planted on its servers
(E2E_FAULT=no-row-transfer, tools/e2e/faults/sitecustomize.py: decode posts no
rows READ). Every pulled block then fails its rows check, a KV load error, and
under the builder's kv_load_failure_policy (fail) decode answers the request
with an error: each comparison of decode's answer with colocated serving must
fail, and only the hand-off's own check still passes.
"""

from __future__ import annotations

import pytest

from tools.testbed.faulted_pytest import run_under_fault

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_control]

TESTS = "tests/v1/kv_connector/test_pd_sampling_mask_e2e.py"


def test_every_comparison_fails_when_decode_reads_no_rows() -> None:
    run = run_under_fault("no-row-transfer", TESTS)
    assert run.returncode == 1, run.output
    assert run.failed == [
        "test_decode_returns_every_row_colocated_serving_returns",
        "test_decode_returns_the_processed_logprobs_colocated_serving_returns",
        "test_decode_returns_the_sampling_masks_colocated_serving_returns",
        "test_decode_samples_the_tokens_colocated_serving_samples",
    ], run.output
