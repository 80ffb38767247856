"""Reduced equivalence harness with rows that travel with the KV (patch
`transfer-routed-experts-rows-with-the-kv-over-nixl`): prefill and decode over
NixlConnector with `enable_routed_experts_transfer` on both roles, driven through
the real `vllm-router` binary (`--vllm-pd-disaggregation`), which returns decode's
response alone. Its rows and tokens must equal the colocated reference's, including a
response whose rows come from three sources (decode's prefix cache, the transfer and
decode's own forward), and a multi-turn conversation, served with decode TP = 2 and
asynchronous scheduling on both roles (docs/deployment-shapes.md) against the TP = 1
synchronous reference. make e2e serves the same at TP = 1, prefill TP = 2 -> decode
TP = 1, the proxy merge in the TP = 2 shape, bf16 through transformers' router
oracle, and rows shifted by one position reported by both checks. A
one-sided switch must fail
decode's NIXL handshake with a message naming both sides' rows formats (in make e2e;
its message at unit level in make test).

The end-to-end negative controls (FAULT=no-row-transfer, FAULT=corrupt-row-tag) run in
`make e2e`, where each costs a deployment; here the same faults are planted at unit
level on the real worker connectors and mirror
(tests/distributed/aux_output_connector/test_rows_transfer.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.v1.kv_connector.e2e_harness import pytest_timeout, run_harness
from tools.testbed.router_oracle import BF16_MARGIN

pytestmark = [pytest.mark.e2e, pytest_timeout()]
TRANSFER = ("--routed-experts-transfer", "--router", "vllm-router")
# Heterogeneous TP (prefill 1, decode 2) with asynchronous scheduling on both roles.
SHAPE = ("--decode-tp", "2", "--async-scheduling")
# three-source-rows: decode's own prefix cache, the transfer and decode's recompute in
# one response (the harness fails it unless decode took >= 32 tokens from its cache).
SCENARIOS = (
    "first-forward-on-block-boundary",
    "prompt-start-mid-prompt",
    "three-source-rows",
)
# The tiny model's rows format, by hand from tools/testbed/tiny_moe.py (2 layers,
# top-2 of 8 experts: uint8 ids) and the harness's 32-token blocks.
TINY_FORMAT = "v1 layers=2 top_k=2 dtype=uint8 block_size=32"


def _summary(output: str) -> tuple[int, int]:
    match = re.search(r"^e2e: (\d+) scenarios, (\d+) mismatches", output, re.M)
    assert match, output[-3000:]
    return int(match.group(1)), int(match.group(2))


def _decode_logs(workdir: Path) -> str:
    return "".join(p.read_text() for p in workdir.glob("logs-*/decode.log"))


# The same at TP = 1 with synchronous scheduling: make e2e (make test serves the
# TP = 2 + async shape below instead).
@pytest.mark.e2e_full
def test_vllm_router_returns_rows_equal_to_colocated(tmp_path: Path) -> None:
    code, output = run_harness(tmp_path, *TRANSFER, "--only", *SCENARIOS, "multi-turn")
    assert (code, *_summary(output)) == (0, 4, 0), output[-3000:]
    assert "front: vllm-router" in output
    logs = _decode_logs(tmp_path)
    assert "Routed-experts rows travel with the KV from engine" in logs  # NIXL set up
    assert "failed their check" not in logs


# The shape GPU deployments serve: decode TP = 2, asynchronous scheduling on both
# roles, with a multi-turn conversation (make test). On 2 cores two measures keep it
# from stalling (docs/deployment-shapes.md, "TP = 2 in make test"): NIXL's
# always-polling progress threads run at nice 19 (tools/testbed/spinners.py), and the
# reference serves first and stops before the P/D roles start. A request that waits
# 90 s gets a report of every thread on the host in stalls.log.
def test_decode_tp_2_with_async_scheduling_returns_rows_equal_to_colocated(
    tmp_path: Path,
) -> None:
    code, output = run_harness(
        tmp_path, *TRANSFER, *SHAPE, "--only", *SCENARIOS, "multi-turn"
    )
    assert (code, *_summary(output)) == (0, 4, 0), output[-3000:]
    assert (
        "front: vllm-router, fault: none, shape: prefill TP 1 -> decode TP 2, async "
        "scheduling" in output
    )
    assert "TP 2 embedding-mask compile warmed" in output, output[-3000:]
    assert "reference: served first" in output
    # The --reduced scenarios' turns (REDUCED in tools/e2e/scenarios.py): one request
    # each in the first two, two turns of one request in the last two.
    assert re.search(r"the reference \(up in \d+ s\) answered 6 distinct", output), (
        output[-3000:]
    )
    # Without it, NIXL's progress threads stall this shape on 2 cores.
    assert re.search(
        r"nice 19 for [1-9]\d* thread\(s\) busy while the deployment is idle", output
    ), output[-3000:]
    logs = _decode_logs(tmp_path)
    assert "Routed-experts rows travel with the KV from engine" in logs  # NIXL set up
    assert "failed their check" not in logs
    # The shape was served as asked: two decode workers, async scheduling on both roles.
    assert "Worker_TP1" in logs, logs[-3000:]
    for role in ("prefill", "decode"):
        log = "".join(p.read_text() for p in tmp_path.glob(f"logs-*/{role}.log"))
        assert "Asynchronous scheduling is on, as requested" in log, (role, log[-2000:])


# The other heterogeneous direction: a TP = 2 prefill hands its KV and rows to a
# TP = 1 decode (NIXL tp_ratio -2). Float32: rows and tokens equal the TP = 1
# reference exactly.
@pytest.mark.e2e_full
def test_prefill_tp_2_to_decode_tp_1_returns_rows_equal_to_colocated(
    tmp_path: Path,
) -> None:
    code, output = run_harness(
        tmp_path, *TRANSFER, "--prefill-tp", "2", "--only", *SCENARIOS
    )
    assert (code, *_summary(output)) == (0, 3, 0), output[-3000:]
    assert "shape: prefill TP 2 -> decode TP 1, sync scheduling" in output
    assert "Routed-experts rows travel with the KV from engine" in _decode_logs(
        tmp_path
    )


# Both roles at TP = 2, asynchronous scheduling: rank i of decode reads rank i of
# prefill (NIXL tp_ratio 1); rows and tokens still equal the TP = 1 reference.
@pytest.mark.e2e_full
def test_tp_2_on_both_roles_returns_rows_equal_to_colocated(tmp_path: Path) -> None:
    code, output = run_harness(
        tmp_path, *TRANSFER, "--prefill-tp", "2", *SHAPE, "--only", *SCENARIOS
    )
    assert (code, *_summary(output)) == (0, 3, 0), output[-3000:]
    assert "shape: prefill TP 2 -> decode TP 2, async scheduling" in output


# The heterogeneous shapes behind the fork's proxy, which merges prefill's and
# decode's rows instead of taking them with the KV.
@pytest.mark.e2e_full
@pytest.mark.parametrize(
    ("shape", "label"),
    [
        (SHAPE, "prefill TP 1 -> decode TP 2, async scheduling"),
        (("--prefill-tp", "2"), "prefill TP 2 -> decode TP 1, sync scheduling"),
    ],
)
def test_the_proxy_merge_returns_rows_equal_to_colocated_in_tp_shapes(
    tmp_path: Path, shape: tuple[str, ...], label: str
) -> None:
    code, output = run_harness(
        tmp_path, "--router", "pdproxy", *shape, "--only", *SCENARIOS, "multi-turn"
    )
    assert (code, *_summary(output)) == (0, 4, 0), output[-3000:]
    assert (
        f"P/D: rows merged by the proxy, front: pdproxy, fault: none, shape: {label}"
        in (output)
    ), output[-3000:]


# In bf16 a TP = 2 forward may pick another expert where two router logits nearly
# tie: rows are checked against transformers' float32 router top-k on each
# response's own tokens, with the measured margin (docs/deployment-shapes.md).
BF16 = (
    "--serve-args",
    "--dtype bfloat16 --block-size 32",
    "--rows-oracle-margin",
    str(BF16_MARGIN),
)


@pytest.mark.e2e_full
def test_bf16_rows_equal_the_router_oracle_up_to_near_ties(tmp_path: Path) -> None:
    code, output = run_harness(tmp_path, *TRANSFER, *SHAPE, *BF16, "--only", *SCENARIOS)
    assert (code, *_summary(output)) == (0, 3, 0), output[-3000:]


@pytest.mark.e2e_full
@pytest.mark.parametrize(
    ("dtype_args", "caught"),
    [
        ((), r"rows differ: P/D start 0 shape \(38, 2, 2\)"),
        (BF16, r"rows differ from transformers' router top-k at \d+ of 38 positions"),
    ],
)
def test_rows_of_another_offset_are_caught_in_this_shape(
    tmp_path: Path, dtype_args: tuple[str, ...], caught: str
) -> None:
    """Negative control of both checks in this shape: decode's rows shifted by one
    position, against the float32 reference and against the bf16 oracle."""
    code, output = run_harness(
        tmp_path,
        *TRANSFER,
        *SHAPE,
        *dtype_args,
        "--fault",
        "shift-decode-rows",
        "--only",
        "first-forward-on-block-boundary",
    )
    assert code == 1 and _summary(output) == (1, 1), output[-3000:]
    assert re.search(caught, output), output[-3000:]


# Three minutes each on 2 cores: make e2e. make test checks the handshake's refusal
# and its message at unit level (tests/distributed/aux_output_connector/
# test_rows_peer_format.py).
@pytest.mark.e2e_full
@pytest.mark.parametrize(
    ("role", "decode_says", "prefill_is"),
    [("prefill", "off", TINY_FORMAT), ("decode", TINY_FORMAT, "off")],
)
def test_a_one_sided_switch_fails_the_handshake_naming_both_sides(
    tmp_path: Path, role: str, decode_says: str, prefill_is: str
) -> None:
    code, output = run_harness(
        tmp_path,
        "--routed-experts-transfer-only-on",
        role,
        "--router",
        "vllm-router",
        "--kv-load-failure-policy",
        "fail",
        "--only",
        "first-forward-on-block-boundary",
    )
    scenarios, mismatches = _summary(output)
    assert code == 1 and scenarios == 1 and mismatches >= 1, output[-3000:]
    logs = _decode_logs(tmp_path)
    assert (
        "routed-experts rows transfer mismatch with remote engine" in logs
        and f"this instance {decode_says}, the remote {prefill_is}." in logs
    ), logs[-3000:]
