"""Reduced equivalence harness: routed experts under NIXL P/D equal colocated serving.

Runs the P/D scenarios of `python -m tools.e2e --reduced` (prefill + decode over
NixlConnector on CPU, the P/D proxy, a colocated reference) and, as the negative
control, the same with the decode emit floor removed, which must be reported. After
each scenario the harness reads the fork's per-request gauges on every server
(docs/metrics.md): finished requests must leave no state behind; the negative control
of that check (`make e2e-controls`) plants a leak of decode's emit floors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.v1.kv_connector.e2e_harness import pytest_timeout, run_harness

pytestmark = [pytest.mark.e2e, pytest_timeout()]
PD_SCENARIOS = (
    "first-forward-on-block-boundary",
    "first-forward-mid-block",
    "prompt-start-mid-prompt",
    "multi-turn",
)


def _run(tmp_path: Path, *args: str) -> tuple[int, str]:
    return run_harness(tmp_path, *args)


def _summary(output: str) -> tuple[int, int]:
    match = re.search(r"^e2e: (\d+) scenarios, (\d+) mismatches", output, re.M)
    assert match, output[-3000:]
    return int(match.group(1)), int(match.group(2))


def test_pd_rows_equal_colocated_rows(tmp_path: Path) -> None:
    code, output = _run(tmp_path, "--only", *PD_SCENARIOS)
    scenarios, mismatches = _summary(output)
    assert (code, scenarios, mismatches) == (0, 4, 0), output[-3000:]


# The floor's unit-level counterpart, in make test:
# tests/distributed/aux_output_connector/test_pd_decode_floor.py.
@pytest.mark.e2e_control
def test_without_the_decode_floor_the_harness_reports_mismatches(
    tmp_path: Path,
) -> None:
    # One scenario (two requests) shows it; each failed decode costs the run minutes.
    code, output = _run(
        tmp_path, "--fault", "no-floor", "--only", "first-forward-mid-block"
    )
    scenarios, mismatches = _summary(output)
    assert code == 1 and scenarios == 1 and mismatches >= 2, output[-3000:]
    # Decode fails closed: its prompt is shorter than a block, so the rows it was never
    # given leave its capture without a start ("object does not exist" when a whole
    # block of them is missing from the store).
    logs = "".join(p.read_text() for p in tmp_path.glob("logs-*/decode.log"))
    assert "auxiliary output capture is not contiguous" in logs, logs[-3000:]


@pytest.mark.e2e_control
def test_a_leak_of_per_request_state_is_reported(tmp_path: Path) -> None:
    """Negative control of the leak check: decode keeps finished requests' emit
    floors. Rows and tokens stay equal; only the gauges show it."""
    code, output = _run(
        tmp_path, "--fault", "leak-floors", "--only", "first-forward-mid-block"
    )
    scenarios, mismatches = _summary(output)
    assert (code, scenarios, mismatches) == (1, 1, 1), output[-3000:]
    assert re.search(
        r"first-forward-mid-block: after every request finished the servers still "
        r"hold state for 2 request\(s\)",
        output,
    ), output[-3000:]
