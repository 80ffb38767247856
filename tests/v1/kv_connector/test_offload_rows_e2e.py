"""Routed-expert rows that travel with offloaded chunks, on real CPU servers (patch
`carry-routed-experts-rows-with-offloaded-kv-chunks`).

Runs `python -m tools.e2e --reduced --routed-experts-transfer --only
offload-colocated-rows-from-0`:
two-turn conversations that ask for every row (routed_experts_prompt_start = 0)
against a server with the native OffloadingConnector (enable_routed_experts_transfer)
and an 8-block KV cache, beside a twin without routed experts and a colocated
reference without offload. Without the switch this scenario loads nothing (the load
limit; test_offload_routed_experts_e2e.py); with it the subject must load what its twin
loads and still return the reference's rows. The negative control corrupts the tag of
the first offloaded chunk each load checks: the harness must report it and exit 1,
and the server must recompute those blocks and still return the reference's rows.

On the prefill role (make e2e: `--routed-experts-transfer --only
offload-on-prefill-rows-from-0`, three turns of three conversations): prefill's
native offload carries the rows, the rows reach decode over NIXL, and prefill must
load what a twin prefill without routed experts loads on the same prompts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.v1.kv_connector.e2e_harness import pytest_timeout, run_harness, run_module

pytestmark = [pytest.mark.e2e, pytest_timeout()]
SCENARIO = "offload-colocated-rows-from-0"
ON_PREFILL = "offload-on-prefill-rows-from-0"


def _row_pattern(scenario: str) -> re.Pattern[str]:
    return re.compile(
        rf"^{scenario}\s+(\d+)\s+(\d+)\s+(\d+)\s+\S+\s+\d+\s+\d+\s+"
        # loaded, withheld, store errors, row checks failed, recomputed loads,
        # (decode hits, rows loaded, leaked), mismatches
        r"(\d+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+\s+\d+\s+\d+\s+(\d+)$",
        re.M,
    )


KEYS = (
    "requests",
    "same_tokens",
    "same_rows",
    "loaded",
    "withheld",
    "store_errors",
    "checks_failed",
    "recomputed",
    "mismatches",
)


def _parse(scenario: str, output: str) -> dict[str, int]:
    (row,) = _row_pattern(scenario).findall(output) or [None]
    assert row is not None, output[-3000:]
    return dict(zip(KEYS, map(int, row), strict=True))


def _run(tmp_path: Path, *args: str) -> tuple[int, str, dict[str, int]]:
    code, output = run_harness(
        tmp_path, "--routed-experts-transfer", "--only", SCENARIO, *args
    )
    return code, output, _parse(SCENARIO, output)


def _assert_rows_carried(
    code: int, output: str, row: dict[str, int], requests: int
) -> None:
    assert code == 0, output[-3000:]
    assert row["same_rows"] == row["same_tokens"] == row["requests"] == requests
    # The twin without routed experts loaded the same: nothing was withheld.
    assert row["loaded"] > 0 and row["withheld"] == 0
    assert row["checks_failed"] == row["store_errors"] == row["mismatches"] == 0
    assert "ratio 1.000" in output


def _assert_recomputed(
    code: int, output: str, row: dict[str, int], requests: int
) -> None:
    """A planted corrupt tag: reported (exit 1), recomputed, rows still equal."""
    assert code == 1, output[-3000:]
    assert row["checks_failed"] > 0 and row["recomputed"] > 0
    assert row["same_rows"] == row["same_tokens"] == row["requests"] == requests


def test_offloaded_chunks_carry_their_rows(tmp_path: Path) -> None:
    _assert_rows_carried(*_run(tmp_path), requests=6)


@pytest.mark.e2e_control
def test_corrupt_rows_are_reported_and_recomputed(tmp_path: Path) -> None:
    code, output, row = _run(
        tmp_path, "--fault", "corrupt-rows", "--kv-load-failure-policy", "recompute"
    )
    _assert_recomputed(code, output, row, requests=6)
    assert row["mismatches"] == row["checks_failed"]  # reported, nothing else wrong
    log = (tmp_path / "logs-offload-colocated" / "subject.log").read_text()
    assert "rows that failed their check (rows of other tokens)" in log


def _run_on_prefill(tmp_path: Path, *args: str) -> tuple[int, str, dict[str, int]]:
    code, output = run_module(
        "tools.e2e",
        "--workdir",
        str(tmp_path),
        "--routed-experts-transfer",
        "--only",
        ON_PREFILL,
        *args,
    )
    return code, output, _parse(ON_PREFILL, output)


@pytest.mark.e2e_full
def test_prefill_offload_carries_rows_to_decode(tmp_path: Path) -> None:
    code, output, row = _run_on_prefill(tmp_path)
    _assert_rows_carried(code, output, row, requests=9)
    assert f"{ON_PREFILL}: loaded {row['loaded']} tokens" in output


# The same with prefill at TP = 2 (docs/deployment-shapes.md): each rank offloads
# its share of every chunk and the chunk's rows travel with it; prefill must load as
# much as its TP = 1 twin without routed experts.
@pytest.mark.e2e_full
def test_a_tp_2_prefill_s_offload_carries_rows_to_decode(tmp_path: Path) -> None:
    code, output, row = _run_on_prefill(tmp_path, "--prefill-tp", "2")
    _assert_rows_carried(code, output, row, requests=9)
    assert "shape: prefill TP 2 -> decode TP 1" in output


@pytest.mark.e2e_control
def test_corrupt_rows_on_prefill_are_reported_and_recomputed(tmp_path: Path) -> None:
    code, output, row = _run_on_prefill(
        tmp_path, "--fault", "corrupt-rows", "--kv-load-failure-policy", "recompute"
    )
    _assert_recomputed(code, output, row, requests=9)
    # Each failed check is a mismatch; the recomputed chunks also stop counting as
    # chunks with rows, so prefill loads less than its twin (one more).
    assert row["withheld"] > 0
    assert row["mismatches"] == row["checks_failed"] + 1
    log = (tmp_path / "logs-offload-pd" / "prefill.log").read_text()
    assert "rows that failed their check (rows of other tokens)" in log
