"""A P/D decode request whose rows travel with the KV, reloaded from the Mooncake
store after its NIXL read failed (patches
`transfer-routed-experts-rows-with-the-kv-over-nixl` and
`store-routed-experts-rows-beside-mooncake-store`).

`python -m tools.e2e.lease_expiry --routed-experts-transfer --store --reuse handoff`
hands prompt A off to prefill (which also saves A's blocks, and their rows objects,
in the Mooncake store), lets A's lease run out and another hand-off take A's blocks,
then sends A's decode request: decode's generation check refuses the read and decode
recomputes A.
The store still holds A's first two blocks and their rows, and decode returns A's rows
from 0: the reload takes both blocks with their rows (checked against A's tokens), so
decode computes the last 6 of the 70 prompt tokens and its rows equal colocated
serving. Before the rows objects, the reload had to stop at the block holding position
0 (decode computed all 70); before that fix decode loaded 64 tokens from the store and
returned rows read from stale rows slots for them (64 of 73 positions differed from
colocated); `--fault unbounded-pd-decode-loads` plants that behaviour (a load that asks
for no rows) and must be reported. A run whose store load itself failed proves
nothing either way (the tool exits 3) and is repeated. The bound itself is
unit-tested on a real Scheduler in tests/v1/core/test_rows_with_kv_decode_loads.py.

Both need the Mooncake store (tools/setup-mooncake.sh), so they run in `make e2e`,
not `make test`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.v1.kv_connector.e2e_harness import pytest_timeout, run_module

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_store, pytest_timeout()]

ARGS = ("--routed-experts-transfer", "--store", "--reuse", "handoff")
COMPUTED = r"decode computed (\d+) of A's 70 prompt tokens"
INCONCLUSIVE = 3  # the store's own load failed (a TCP get timing out on a busy host)


def lease_expiry(tmp_path: Path, *extra: str) -> tuple[int, str]:
    """The run, again (at most twice more) while it is inconclusive."""
    for attempt in range(3):
        workdir = tmp_path / f"run-{attempt}"
        code, output = run_module(
            "tools.e2e.lease_expiry", *ARGS, *extra, "--workdir", str(workdir)
        )
        if code != INCONCLUSIVE:
            break
    return code, output


def test_a_store_reload_stops_where_the_rows_start(tmp_path: Path) -> None:
    code, output = lease_expiry(tmp_path)
    assert code == 0, output[-3000:]
    computed = re.search(COMPUTED, output)
    assert computed and computed.group(1) == "6", output[-3000:]
    assert "decode's answer for A equals colocated" in output


@pytest.mark.e2e_control
def test_an_unbounded_store_reload_is_reported(tmp_path: Path) -> None:
    code, output = lease_expiry(tmp_path, "--fault", "unbounded-pd-decode-loads")
    assert code == 1, output[-3000:]
    computed = re.search(COMPUTED, output)
    assert computed and int(computed.group(1)) < 70, output[-3000:]
    assert re.search(r"rows differ: .* (\d+) of 73 positions differ", output), output[
        -3000:
    ]
