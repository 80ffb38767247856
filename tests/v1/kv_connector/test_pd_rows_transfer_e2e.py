"""Reduced equivalence harness with rows that travel with the KV (patch
`transfer-routed-experts-rows-with-the-kv-over-nixl`): prefill and decode over
NixlConnector with `enable_routed_experts_transfer` on both roles, driven through
the real `vllm-router` binary (`--vllm-pd-disaggregation`), which returns decode's
response alone. Its rows and tokens must equal the colocated reference's.

The end-to-end negative controls (FAULT=no-row-transfer, FAULT=corrupt-row-tag) run in
`make e2e`, where each costs a deployment; here the same faults are planted at unit
level on the real worker connectors and mirror
(tests/distributed/aux_output_connector/test_rows_transfer.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from e2e_harness import run_harness

from tests.fork_base import only_with_rows_transfer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200), only_with_rows_transfer]
TRANSFER = ("--rows-transfer", "--router", "vllm-router")
SCENARIOS = ("first-forward-on-block-boundary", "prompt-start-mid-prompt", "multi-turn")


def _summary(output: str) -> tuple[int, int]:
    match = re.search(r"^e2e: (\d+) scenarios, (\d+) mismatches", output, re.M)
    assert match, output[-3000:]
    return int(match.group(1)), int(match.group(2))


def _decode_logs(workdir: Path) -> str:
    return "".join(p.read_text() for p in workdir.glob("logs-*/decode.log"))


def test_vllm_router_returns_rows_equal_to_colocated(tmp_path: Path) -> None:
    code, output = run_harness(tmp_path, *TRANSFER, "--only", *SCENARIOS)
    assert (code, *_summary(output)) == (0, 3, 0), output[-3000:]
    assert "front: vllm-router" in output
    logs = _decode_logs(tmp_path)
    assert "Routed-experts rows travel with the KV from engine" in logs  # NIXL set up
    assert "failed their check" not in logs
