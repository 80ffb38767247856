"""The equivalence harness serves the chains `vllm kv-transfer-config` builds (patch
add-vllm-kv-transfer-config-per-role-p-d-connector): a P/D deployment described
by builder flags (`python -m tools.e2e --pd-chain`), run for
real on CPU. This is the code path the GPU procedure for HiSparse decode takes
(docs/deployments/hisparse-decode.md), with the chains that run on CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.v1.kv_connector.e2e_harness import pytest_timeout, run_harness

pytestmark = [pytest.mark.e2e, pytest_timeout()]


def _kv_transfer_config(log: Path) -> dict:
    """The --kv-transfer-config the server was started with (its non-default args)."""
    line = next(
        line for line in log.read_text().splitlines() if "non-default args" in line
    )
    match = re.search(
        r"kv_connector='(\w+)'.*?kv_connector_extra_config=(\{.*?\}), "
        r"kv_connector_module_path",
        line,
    )
    assert match, line
    return {"kv_connector": match.group(1), "extra": match.group(2)}


def test_harness_runs_builder_chains(tmp_path: Path) -> None:
    flags = "--prefill-offload native:64MiB"
    returncode, output = run_harness(
        tmp_path, "--pd-chain", flags, "--only", "first-forward-mid-block", "multi-turn"
    )
    assert re.search(r"^e2e: 2 scenarios, 0 mismatches", output, re.M), output[-3000:]
    assert returncode == 0
    # The builder's summaries, one per role, and the chains the servers really got.
    assert (
        "prefill: NixlConnector (P/D KV transfer) -> native CPU offload (64 MiB)"
        in output
    )
    assert "decode: NixlConnector (P/D KV transfer)\n" in output
    prefill = _kv_transfer_config(tmp_path / "logs-base" / "prefill.log")
    decode = _kv_transfer_config(tmp_path / "logs-base" / "decode.log")
    assert prefill["kv_connector"] == "MultiConnector"
    assert "'kv_connector': 'OffloadingConnector'" in prefill["extra"]
    assert "'cpu_bytes_to_use': 67108864" in prefill["extra"]
    assert decode["kv_connector"] == "NixlConnector"
    # What the harness adds for a CPU host, and nothing else.
    assert decode["extra"] == str({"num_threads": 1, "kv_lease_duration": 900})
