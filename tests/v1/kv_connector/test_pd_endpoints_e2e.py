"""Every endpoint under P/D, streamed and not, in both P/D modes (patches
`return-routed-experts-rows-in-the-final-stream-chunk` and
`transfer-routed-experts-rows-with-the-kv-over-nixl`, and the proxy's stream merge).

Runs `python -m tools.e2e.pd_endpoints`: prefill and decode over NixlConnector and a
colocated reference, on /v1/completions, /v1/chat/completions and
/inference/v1/generate, rows from 0 and from inside block 1. Each P/D answer must equal
the reference's non-streaming answer (tokens, start, rows); streamed, each choice's
final chunk carries the rows (n = 2: an RL group, prefilled once and read once) and
no earlier chunk any.
- merge mode: the proxy merges prefill's and decode's rows, streamed too;
- rows mode: rows travel with the KV; the real `vllm-router` forwards decode's answer
  and the proxy passes it on.
Negative controls: decode's rows shifted by one position (the merge mode must report
the rows of every endpoint as different), and the rows transfer switched off (decode
holds only its own rows, so the router's answers start at P - 1, while the proxy in
front of the same pair still merges complete rows).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.v1.kv_connector.e2e_harness import pytest_timeout, run_module

pytestmark = [pytest.mark.e2e, pytest_timeout()]

# Per front end and endpoint, 2 prompts x (3 non-streamed checks + 1 streamed + 3 per
# choice of the n = 2 streamed): 20.
CHECKS = {"completions": 20, "chat": 20, "generate": 20}
ALL = sum(CHECKS.values())


# In make e2e: make test serves every endpoint through the proxy in the rows mode
# below, and tests the proxy's merge of each endpoint on recorded bodies
# (tests/pdproxy/).
@pytest.mark.e2e_full
def test_the_proxy_merges_every_endpoint_streamed_and_not(tmp_path: Path) -> None:
    code, output = run_module("tools.e2e.pd_endpoints", "--workdir", str(tmp_path))
    assert code == 0, output[-3000:]
    assert "mode proxy-merge, front: pdproxy," in output
    assert f"pd-endpoints: {ALL} checks, 0 failed" in output


# make test's run: the prompt whose rows start inside block 1 (prefill's transfer and
# decode's forward both contribute), through vllm-router alone; both prompts and both
# fronts in make e2e below.
def test_rows_with_the_kv_reach_every_endpoint_through_vllm_router(
    tmp_path: Path,
) -> None:
    code, output = run_module(
        "tools.e2e.pd_endpoints",
        "--mode",
        "rows-over-nixl",
        "--router",
        "vllm-router",
        "--reduced",
        "--workdir",
        str(tmp_path),
    )
    assert code == 0, output[-3000:]
    header = (
        "mode rows-over-nixl, front: vllm-router, fault: none, "
        "prompts: P=70 rows from 33,"
    )
    assert header in output
    # All three endpoints, one prompt (half of 20 each), n = 2 streamed.
    assert f"pd-endpoints: {ALL // 2} checks, 0 failed" in output


# The proxy in front of the same pair too: make e2e (make test serves the proxy in
# the reduced harness).
@pytest.mark.e2e_full
def test_rows_with_the_kv_reach_every_endpoint_through_both_fronts(
    tmp_path: Path,
) -> None:
    code, output = run_module(
        "tools.e2e.pd_endpoints", "--mode", "rows-over-nixl", "--workdir", str(tmp_path)
    )
    assert code == 0, output[-3000:]
    assert "mode rows-over-nixl, front: vllm-router, pdproxy," in output
    # Both front ends, all three endpoints.
    assert f"pd-endpoints: {2 * ALL} checks, 0 failed" in output


@pytest.mark.e2e_control
def test_shifted_decode_rows_are_caught_on_every_endpoint(tmp_path: Path) -> None:
    code, output = run_module(
        "tools.e2e.pd_endpoints",
        "--fault",
        "shift-decode-rows",
        "--workdir",
        str(tmp_path),
    )
    assert code == 1, output[-3000:]
    for endpoint in ("completions", "chat", "generate"):
        for suffix in ("", ", streamed, choice 0"):
            name = f"{endpoint} P=45, rows from 0{suffix}"
            needle = f"FAIL pdproxy: {name}: rows equal the"
            assert needle in output, needle
    # Tokens are untouched by the fault: only the rows differ.
    assert "tokens equal the reference's: " not in output


@pytest.mark.e2e_control
def test_without_the_transfer_the_router_returns_incomplete_rows(
    tmp_path: Path,
) -> None:
    code, output = run_module(
        "tools.e2e.pd_endpoints",
        "--mode",
        "rows-over-nixl",
        "--no-routed-experts-transfer",
        "--workdir",
        str(tmp_path),
    )
    assert code == 1, output[-3000:]
    # Decode returns rows from its first forward (P - 1) on, not from 0 or 33, and the
    # router forwards them as they are.
    for endpoint in ("completions", "chat", "generate"):
        assert (
            f"FAIL vllm-router: {endpoint} P=45, rows from 0: "
            "routed_experts_start = 0: 44" in output
        )
        assert (
            f"FAIL vllm-router: {endpoint} P=70, rows from 33, streamed, choice 0: "
            "routed_experts_start = 33: [69]" in output
        )
    # The proxy in front of the same pair merges prefill's rows: nothing fails there.
    assert "FAIL pdproxy" not in output
