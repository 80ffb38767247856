"""Streamed P/D responses with rows that travel with the KV (patches
`transfer-routed-experts-rows-with-the-kv-over-nixl` and
`return-routed-experts-rows-in-the-final-stream-chunk`).

Runs `python -m tools.e2e.pd_streaming`: prefill and decode over NixlConnector with
`enable_routed_experts_transfer` on both roles behind the real `vllm-router` binary,
which streams decode's response through. Each prompt's final chunk must carry the rows
of [routed_experts_prompt_start, P + C - 1), equal to a colocated reference's
non-streaming rows, and no earlier chunk any. The negative control turns the switch
off, so decode's stream holds decode's rows only, and the run must fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_harness import run_module

from tests.fork_base import only_with_rows_transfer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200), only_with_rows_transfer]


def test_vllm_router_streams_every_row_in_the_final_chunk(tmp_path: Path) -> None:
    code, output = run_module("tools.e2e.pd_streaming", "--workdir", str(tmp_path))
    assert code == 0, output[-3000:]
    assert "pd-streaming: 8 checks, 0 failed" in output
    assert "front: vllm-router" in output


@pytest.mark.e2e_control
def test_without_the_transfer_the_streamed_rows_are_incomplete(tmp_path: Path) -> None:
    code, output = run_module(
        "tools.e2e.pd_streaming", "--no-transfer", "--workdir", str(tmp_path)
    )
    assert code == 1, output[-3000:]
    # Decode returns rows from its first forward (P - 1) on, not from 0 or 33.
    assert "FAIL P=45, rows from 0: routed_experts_start = 0: 44" in output
    assert "FAIL P=70, rows from 33: routed_experts_start = 33: 69" in output
