"""The reduced soak (`python -m tools.e2e.soak`): 16 seeded random requests on
1P1D with rows that travel with the KV, client aborts, a decode KV cache small enough to
preempt and multi-turn reuse, one of them an RL group (n = 4, seeded and sampled:
prefilled once, its hand-off read once by decode's four children); every completed
response equal to colocated serving (a group's every choice, by index) and no
per-request state (nor KV held for decode, nor decode's pinned KV) left on either
server. `make soak` runs the full one: 500 requests, with decode and then prefill
SIGKILLed and restarted (each restart costs this 2-core machine minutes, so the reduced
one has none; a 45 s lease bounds the final wait for the KV prefill holds for aborted
hand-offs).

The negative control (`make e2e-controls`) plants rows shifted by one position on
decode: the soak must count mismatches and exit 1. Its verdict, the plan (seed 0's 16
requests hold one group, not aborted) and the group comparison are unit-tested in
tests/v1/e2e/test_soak_plan.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.v1.kv_connector.e2e_harness import pytest_timeout, run_module

SOAK_TIMEOUT_S = 1700
GROUP_SIZE = 4
pytestmark = [pytest.mark.e2e, pytest_timeout(SOAK_TIMEOUT_S)]


def _table(output: str) -> dict[str, str]:
    return dict(
        re.findall(
            r"^(requests sent|completed, equal to colocated|mismatches \(must be "
            r"0\)|leaked per-request state \(must be 0\)|aborted by the client|"
            r"group requests \(n > 1\) sent|groups completed, every choice equal)"
            r"\s+(\S+)$",
            output,
            re.M,
        )
    )


def _soak(tmp_path: Path, *args: str) -> tuple[int, str]:
    """The soak without server kills; its exit code and output."""
    return run_module(
        "tools.e2e.soak",
        "--faults",
        "",
        "--workdir",
        str(tmp_path),
        *args,
        timeout=SOAK_TIMEOUT_S,
    )


def test_the_reduced_soak_finds_nothing_wrong_and_nothing_left(tmp_path: Path) -> None:
    code, output = _soak(tmp_path, "--requests", "16", "--lease", "45",
                         "--group-size", str(GROUP_SIZE))
    assert code == 0, output[-4000:]
    table = _table(output)
    assert table["requests sent"] == "16", output[-4000:]
    assert table["mismatches (must be 0)"] == "0"
    assert table["leaked per-request state (must be 0)"] == "0"
    # No server fault: every request that was not aborted completes.
    assert (
        int(table["completed, equal to colocated"])
        + int(table["aborted by the client"])
        == 16
    ), output[-4000:]
    # The plan's one group (P = 216, C = 32, rows from 0; not aborted) completed, each of
    # its choices equal to the reference's choice of the same index.
    assert table["group requests (n > 1) sent"] == "1", output[-4000:]
    assert table["groups completed, every choice equal"] == "1", output[-4000:]


@pytest.mark.e2e_control
def test_shifted_rows_are_counted_as_mismatches(tmp_path: Path) -> None:
    code, output = _soak(tmp_path, "--requests", "12", "--fault", "shift-decode-rows")
    assert code == 1, output[-4000:]
    assert int(_table(output)["mismatches (must be 0)"]) > 0, output[-4000:]
