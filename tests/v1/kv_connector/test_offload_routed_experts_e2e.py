"""Reduced equivalence harness with vLLM's native KV offload on CPU (patches
bound-offload-loads-to-positions-without-routed,
cut-local-prefix-hits-at-kv-blocks-filled-by,
run-the-native-offload-worker-on-the-cpu-platform; the withheld-tokens count is
count-routed-experts-rows-and-control-plane-state's).

Runs the offload scenarios of `python -m tools.e2e --reduced`: multi-turn
conversations against a server with OffloadingConnector and an 8-block KV cache,
beside a twin without routed experts and a colocated reference without offload.
Turns that ask for rows from the previous turn's end on must load from offload and
match the reference; turns that ask for rows from 0 must load nothing, and the
server counts the tokens it withheld as its twin shows them. The negative
control removes the load limit, which must surface as BlockObjectStoreError and
mismatches."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.v1.kv_connector.e2e_harness import pytest_timeout, run_harness

pytestmark = [pytest.mark.e2e, pytest_timeout()]
ROW = re.compile(
    r"^(offload-colocated-[\w-]+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\S+\s+\d+\s+\d+\s+"
    # loaded, withheld, store errors, (row checks failed, recomputed loads, decode
    # hits, rows loaded, leaked), mismatches
    r"(\d+)\s+(\S+)\s+(\d+)\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+\s+(\d+)$",
    re.M,
)
COUNTED = re.compile(
    r"^  (offload-colocated-[\w-]+): the subject counted (\d+) withheld tokens", re.M
)


def _run(tmp_path: Path, *args: str) -> tuple[int, str]:
    return run_harness(
        tmp_path,
        "--only",
        "offload-colocated-multi-turn",
        "offload-colocated-rows-from-0",
        *args,
    )


def _rows(output: str) -> dict[str, dict[str, int]]:
    rows = {}
    for name, requests, tokens, same_rows, loaded, withheld, errors, bad in ROW.findall(
        output
    ):
        rows[name] = {
            "requests": int(requests),
            "same_tokens": int(tokens),
            "same_rows": int(same_rows),
            "loaded": int(loaded),
            "withheld": int(withheld),
            "store_errors": int(errors),
            "mismatches": int(bad),
        }
    assert len(rows) == 2, output[-3000:]
    return rows


def test_offloaded_turns_load_and_equal_colocated_rows(tmp_path: Path) -> None:
    code, output = _run(tmp_path)
    assert code == 0, output[-3000:]
    rows = _rows(output)
    multi, from_0 = (
        rows["offload-colocated-multi-turn"],
        rows["offload-colocated-rows-from-0"],
    )
    assert multi["same_rows"] == multi["same_tokens"] == multi["requests"] == 6
    assert (
        multi["loaded"] > 0 and multi["withheld"] == 0
    )  # only rowless positions loaded
    assert from_0["same_rows"] == from_0["requests"] == 6
    assert (
        from_0["loaded"] == 0 and from_0["withheld"] > 0
    )  # the twin loaded, we did not
    assert "e2e: 2 scenarios, 0 mismatches" in output
    # The server's own count (vllm:kv_offload_routed_experts_withheld_tokens) is
    # what the twin, on the same traffic without routed experts, loaded beyond it.
    counted = {name: int(tokens) for name, tokens in COUNTED.findall(output)}
    assert counted == {name: row["withheld"] for name, row in rows.items()}, output[
        -3000:
    ]


# The limit's unit-level counterpart, in make test:
# tests/distributed/aux_output_connector/test_offload_load_limit.py.
@pytest.mark.e2e_control
def test_without_the_load_limit_the_harness_reports_the_store_error(
    tmp_path: Path,
) -> None:
    code, output = _run(tmp_path, "--fault", "no-clamp")
    assert code == 1, output[-3000:]
    from_0 = _rows(output)["offload-colocated-rows-from-0"]
    assert from_0["store_errors"] >= 1 and from_0["mismatches"] >= 1, output[-3000:]
    assert (
        "BlockObjectStoreError"
        in (tmp_path / "logs-offload-colocated" / "subject.log").read_text()
    )
