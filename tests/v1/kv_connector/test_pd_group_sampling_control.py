"""The negative control of tests/v1/kv_connector/test_pd_group_sampling_e2e.py, in a
separate run.

The same P/D deployment serves again with a fault planted on its servers
(E2E_FAULT=unshared-handoff-loads, tools/e2e/faults/sitecustomize.py: NIXL names
no hand-off, so every child of an n > 1 request pulls it itself, as before
shared loads). Decode then makes n times the transfers of one request, and
prefill logs the notifications of a hand-off it already freed: the read-once
and notify-once checks must fail. Prefill's own check still passes. (Whether the
late reads return the right KV depends on whether prefill reused the freed
blocks in between, so the equality checks are not part of this control.)
"""

from __future__ import annotations

import pytest

from tools.testbed.faulted_pytest import run_under_fault

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_control]

TESTS = "tests/v1/kv_connector/test_pd_group_sampling_e2e.py"


def test_reading_once_fails_when_every_child_pulls() -> None:
    run = run_under_fault("unshared-handoff-loads", TESTS)
    assert run.returncode == 1, run.output
    failed = set(run.failed)
    assert {
        "test_a_group_costs_decode_the_transfers_of_one_request",
        "test_nothing_is_held_and_nobody_notifies_twice",
    } <= failed, run.output
    assert "test_prefill_runs_one_sequence_per_hand_off" not in failed, run.output
