"""Routed-expert rows stored beside Mooncake store chunks, on real CPU servers (patch
`store-routed-experts-rows-beside-mooncake-store`).

Runs `python -m tools.e2e --routed-experts-transfer --only mooncake-pd-rows-from-0
mooncake-pd-decode-kv-rows-from-0`: 1P1D over NIXL, both roles with the Mooncake
store and the switch (prefill gives the store its memory; decode saves its decode KV
there), a twin prefill without routed experts under its own cache prefix in the same
store, and a colocated reference without any KV connector.

- rows-from-0: three conversations of three turns that ask for every row. Without the
  switch prefill loads nothing from the store (the load limit); with it prefill must
  load at least 0.99 of what its twin loads, and every request must return the
  reference's tokens and rows.
- decode-kv-rows-from-0: 65-token prompts and 40-token completions, every row asked
  for. The completion fills block 2 on decode only; the next turn's prefill can get
  it only from what decode stored (`save_decode_cache`), and only with its rows
  object, since the request returns that block's rows.

The negative control corrupts the tag of the first rows object each load checks
(`corrupt-rows`, with `kv_load_failure_policy=recompute`): the harness must report it
and exit 1, prefill must count failed checks and recompute, and the rows returned must
still equal the reference's.

Needs the Mooncake store (tools/setup-mooncake.sh): `make e2e`, not `make test`. The
store's rows objects are unit-tested against a fake store in
tests/v1/kv_connector/unit/test_mooncake_store_rows.py, which `make test` runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.v1.kv_connector.e2e_harness import pytest_timeout, run_module

STORE_RUN_TIMEOUT_S = 1400
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.e2e_store,
    pytest_timeout(STORE_RUN_TIMEOUT_S),
]
ROWS_FROM_0 = "mooncake-pd-rows-from-0"
DECODE_KV = "mooncake-pd-decode-kv-rows-from-0"
KEYS = (
    "requests",
    "same_tokens",
    "same_rows",
    "loaded",
    "withheld",
    "store_errors",
    "checks_failed",
    "recomputed",
    "rows_loaded",
    "mismatches",
)


def _parse(scenario: str, output: str) -> dict[str, int | None]:
    """The scenario's row of the harness table; a column the harness leaves at "-"
    (withheld, when the deployment has no twin to compare with) is None."""
    pattern = re.compile(
        rf"^{scenario}\s+(\d+)\s+(\d+)\s+(\d+)\s+\S+\s+\d+\s+\d+\s+"
        # loaded, withheld, store errors, row checks failed, recomputed loads,
        # decode hits, rows loaded, leaked, mismatches
        r"(\d+)\s+(\d+|-)\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+\s+(\d+)\s+\d+\s+(\d+)$",
        re.M,
    )
    (row,) = pattern.findall(output) or [None]
    assert row is not None, output[-3000:]
    values = [None if value == "-" else int(value) for value in row]
    return dict(zip(KEYS, values, strict=True))


def _run(tmp_path: Path, *args: str) -> tuple[int, str]:
    return run_module(
        "tools.e2e",
        "--workdir",
        str(tmp_path),
        "--routed-experts-transfer",
        "--only",
        *args,
        timeout=STORE_RUN_TIMEOUT_S,
    )


def _ratio(scenario: str, output: str) -> float:
    match = re.search(rf"{scenario}: .*ratio (\d+\.\d+)", output)
    assert match is not None, output[-3000:]
    return float(match.group(1))


def test_store_chunks_carry_their_rows_on_both_roles(tmp_path: Path) -> None:
    code, output = _run(tmp_path, ROWS_FROM_0, DECODE_KV)
    assert code == 0, output[-3000:]
    from_0 = _parse(ROWS_FROM_0, output)
    assert from_0["same_rows"] == from_0["same_tokens"] == from_0["requests"] == 9
    assert from_0["loaded"] > 0 and _ratio(ROWS_FROM_0, output) >= 0.99
    assert from_0["rows_loaded"] > 0
    decode_kv = _parse(DECODE_KV, output)
    assert decode_kv["same_rows"] == decode_kv["same_tokens"] == decode_kv["requests"]
    # What prefill loads here only decode computed (one conversation fits prefill's
    # KV cache, so its own blocks stay local), and it returns those blocks' rows.
    assert decode_kv["loaded"] > 0
    for row in (from_0, decode_kv):
        assert row["checks_failed"] == row["store_errors"] == row["mismatches"] == 0


def test_tp_2_roles_store_chunks_with_their_rows(tmp_path: Path) -> None:
    """Both roles at TP = 2 (docs/deployment-shapes.md): each rank puts its share of
    every chunk, the rows objects go with them, and prefill loads as much as its
    TP = 1 twin without routed experts. (Roles of different TP must not share the
    store's keys: the same page says why.)"""
    code, output = _run(tmp_path, ROWS_FROM_0, "--prefill-tp", "2", "--decode-tp", "2")
    assert code == 0, output[-3000:]
    assert "shape: prefill TP 2 -> decode TP 2" in output
    row = _parse(ROWS_FROM_0, output)
    assert row["same_rows"] == row["same_tokens"] == row["requests"] == 9
    assert row["loaded"] > 0 and _ratio(ROWS_FROM_0, output) >= 0.99
    assert row["checks_failed"] == row["store_errors"] == row["mismatches"] == 0


@pytest.mark.e2e_control
def test_corrupt_store_rows_are_reported_and_recomputed(tmp_path: Path) -> None:
    code, output = _run(
        tmp_path,
        ROWS_FROM_0,
        "--fault",
        "corrupt-rows",
        "--kv-load-failure-policy",
        "recompute",
    )
    assert code == 1, output[-3000:]
    row = _parse(ROWS_FROM_0, output)
    assert row["checks_failed"] > 0 and row["recomputed"] > 0
    assert row["same_rows"] == row["same_tokens"] == row["requests"] == 9
    log = (tmp_path / "logs-mooncake-pd" / "prefill.log").read_text()
    assert "rows that failed their check" in log
