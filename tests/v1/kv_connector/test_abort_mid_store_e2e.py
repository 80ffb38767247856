"""Rollouts abort often: requests the client hangs up on while their chunks are being
stored must leave no KV block held (python -m tools.e2e's `*-abort-mid-store`
scenarios). Each prompt is sent and hung up on after its first token, then
sent again and checked against colocated serving; once every request finished, each
server's vllm:kv_cache_usage_perc must read 0 (cached blocks count as free). The
negative control plants a leak: the native offload's scheduler keeps every finished
request's blocks for a store completion that never comes (FAULT=hold-finished-blocks),
which must be reported."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.v1.kv_connector.e2e_harness import pytest_timeout, run_module

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_full, pytest_timeout()]


def run_harness(workdir: Path, *args: str) -> tuple[int, str]:
    """The full harness (these scenarios are not in --reduced)."""
    return run_module("tools.e2e", "--workdir", str(workdir), *args)


def _summary(output: str) -> tuple[int, int]:
    match = re.search(r"^e2e: (\d+) scenarios, (\d+) mismatches", output, re.M)
    assert match, output[-3000:]
    return int(match.group(1)), int(match.group(2))


def test_aborted_requests_leave_no_kv_block_held(tmp_path: Path) -> None:
    code, output = run_harness(tmp_path, "--only", "offload-colocated-abort-mid-store")
    assert (code, *_summary(output)) == (0, 1, 0), output[-3000:]
    assert "KV blocks are still held" not in output


@pytest.mark.e2e_control
def test_blocks_held_after_the_requests_are_reported(tmp_path: Path) -> None:
    code, output = run_harness(
        tmp_path, "--only", "offload-colocated-abort-mid-store",
        "--fault", "hold-finished-blocks",
    )
    scenarios, mismatches = _summary(output)
    assert code == 1 and scenarios == 1 and mismatches >= 1, output[-3000:]
    assert re.search(r"KV blocks are still held \(vllm:kv_cache_usage_perc: subject "
                     r"\d+\.\d+%", output), output[-3000:]
