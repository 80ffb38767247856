"""Decode never answers from KV that prefill released on lease expiry (patch
`fail-closed-when-decode-reads-blocks-released-on`), served on CPU over real NIXL.

`python -m tools.e2e.lease_expiry` is the router: it hands prompt A off to a prefill
with a 5 s lease and 7 usable KV blocks, lets prompt B wait for A's lease to run out
and take A's blocks, and only then sends A's decode request. Stock vLLM 0.31.0 answers
A from B's KV there (docs/r3-pd.md, "NIXL lease expiry"); the fork's decode must refuse
the read (its generation check), recompute A and answer exactly as colocated serving.

The end-to-end negative control (`--fault no-lease-check`, decode without the
comparison: exit 1 with A answered from reused KV) and the `fail` policy run in
`make e2e`; here the same fault is planted at unit level
(tests/v1/kv_connector/unit/test_nixl_lease_generations.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.v1.kv_connector.e2e_harness import pytest_timeout, run_module

pytestmark = [pytest.mark.e2e, pytest_timeout()]


def test_decode_recomputes_a_request_whose_lease_expired(tmp_path: Path) -> None:
    code, output = run_module("tools.e2e.lease_expiry", "--workdir", str(tmp_path))
    assert code == 0, output[-3000:]
    # What the tool printed, checked here too: the lease expired, decode's check
    # refused the read, decode computed all 70 prompt tokens itself, same answer.
    expired = re.search(
        r"prefill logged 'Releasing expired KV blocks' (\d+) time", output
    )
    assert expired and int(expired.group(1)) >= 1, output[-3000:]
    computed = re.search(
        r"decode computed (\d+) of A's 70 prompt tokens"
        r".*generation checks failed: (\d+)",
        output,
    )
    assert computed and computed.group(1) == "70" and int(computed.group(2)) >= 1
    assert "decode's answer for A equals colocated" in output
    # Decode names the block and both generations; expiry only ever bumps.
    decode_log = (tmp_path / "logs" / "decode.log").read_text()
    refused = re.search(
        r"block \d+ of engine \S+ rank 0 is at generation (\d+), "
        r"the hand-off's was (\d+)",
        decode_log,
    )
    assert refused and int(refused.group(1)) > int(refused.group(2)), decode_log[-3000:]
