"""The GPU cost procedure (benchmarks/gpu/r3_cost.py): its response check, on hand-made
responses in the wire format the fork's client decoder documents (a base64 .npy of
shape (rows, layers, top_k), uint8 or uint16), and its CPU mode end to end on the
smallest routing-shape preset (make e2e), so that the procedure cannot rot.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.cpu_meter import CpuUse
from benchmarks.gpu.r3_cost import (
    Answer,
    ResponseError,
    RoundResult,
    Routing,
    Target,
    cached_tokens,
    check_loads,
    check_response,
    cycle_ratios,
    deployment_order,
    main,
    parse_args,
    prompts,
    salted,
    start_pd,
)

ROUTING = Routing(num_layers=3, top_k=2, num_experts=300)  # uint16 ids
PROMPT = [5, 6, 7, 8]


def npy_b64(rows: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, rows)
    return base64.b64encode(buffer.getvalue()).decode()


def response(num_rows: int, *, start: int = 0, layers: int = 3, top_k: int = 2,
             top_id: int = 299, tokens: int = 2, rows: bool = True) -> dict[str, Any]:
    """A completion response with `num_rows` rows whose values name their position."""
    choice: dict[str, Any] = {"token_ids": list(range(tokens))}
    if rows:
        values = (np.arange(num_rows * layers * top_k) % (top_id + 1)).astype(np.uint16)
        values[-1:] = top_id
        choice["routed_experts"] = npy_b64(values.reshape(num_rows, layers, top_k))
        choice["routed_experts_start"] = start
    return {"choices": [choice]}


def test_a_complete_answer_returns_its_rows() -> None:
    # P + C - 1 = 4 + 2 - 1 positions, from 0; from P = 4, C - 1 = 1.
    rows = check_response(response(5), PROMPT, 2, ROUTING)
    assert rows is not None and rows.shape == (5, 3, 2) and int(rows[1, 0, 0]) == 6
    rows = check_response(response(1, start=4), PROMPT, 2, ROUTING, start=4)
    assert rows is not None and rows.shape == (1, 3, 2)
    assert check_response(response(0, rows=False), PROMPT, 2, None) is None


@pytest.mark.parametrize("planted, needle", [
    (dict(num_rows=4), "rows are missing"),  # a row short (the decoder's count)
    (dict(num_rows=5, start=1), "rows are missing"),  # rows that start late
    (dict(num_rows=5, layers=2), "shape"),  # rows of another model
    (dict(num_rows=5, top_id=300), "expert id 300"),  # an id the model lacks
    (dict(num_rows=5, tokens=1), "1 tokens returned"),  # a short completion
])
def test_planted_faults_stop_the_run(planted: dict[str, Any], needle: str) -> None:
    with pytest.raises(ResponseError, match=needle):
        check_response(response(**planted), PROMPT, 2, ROUTING)


def test_rows_from_zero_where_rows_from_p_were_asked_for_stop_the_run() -> None:
    with pytest.raises(ResponseError, match="expected from 4"):
        check_response(response(5), PROMPT, 2, ROUTING, start=4)


def rows_named(*values: int) -> np.ndarray:
    """One row per value, every id of the row that value."""
    return np.repeat(np.array(values, dtype=np.uint8), 6).reshape(len(values), 3, 2)


def test_loaded_rows_equal_to_the_computed_ones_pass() -> None:
    # 2 of 4 positions loaded; the recomputed positions past them may differ.
    check_loads(Answer(0, rows_named(1, 2, 3, 4), 0), Answer(0, rows_named(1, 2, 9, 9), 2),
                prompt_tokens=4)
    # Rows from P = 4: none of them was loaded, nothing to compare.
    check_loads(Answer(0, rows_named(7), 0), Answer(0, rows_named(8), 2),
                prompt_tokens=4, rows_start=4)


@pytest.mark.parametrize("first, second, needle", [
    # A loaded row that is not the stored one, at position 1.
    ((rows_named(1, 2, 3), 0), (rows_named(1, 5, 3), 3), "differ .* at 1 of 3 positions, "
     "first 1"),
    # The first send was served from a cache: its chunks were not stored by it.
    ((rows_named(1, 2, 3), 2), (rows_named(1, 2, 3), 2), "first send found 2"),
    # Nothing loaded: the offload tier did not serve the second send.
    ((rows_named(1, 2, 3), 0), (rows_named(1, 2, 3), 0), "loaded none of its 4"),
])
def test_planted_load_faults_stop_the_run(first: tuple, second: tuple, needle: str
                                          ) -> None:
    with pytest.raises(ResponseError, match=needle):
        check_loads(Answer(0, *first), Answer(0, *second), prompt_tokens=4)


def test_cached_tokens_come_from_the_usage_details() -> None:
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 32}}}) == 32
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": None}}}) == 0
    with pytest.raises(ResponseError, match="--enable-prompt-tokens-details"):
        cached_tokens({"usage": {"prompt_tokens": 4}})


def test_rows_where_none_were_asked_for_stop_the_run() -> None:
    with pytest.raises(ResponseError, match="none were asked for"):
        check_response(response(5), PROMPT, 2, None)
    with pytest.raises(ResponseError, match="the request failed"):
        check_response({"error": "HTTP 500"}, PROMPT, 2, ROUTING)


PROMPT_TOKENS, COMPLETION_TOKENS = 40, 3
WITH_ROWS = PROMPT_TOKENS + COMPLETION_TOKENS - 1  # P + C - 1 rows, from 0


def run_cpu_mode(tmp_path: Path, *deployments: str) -> dict[str, Any]:
    """The CPU mode on the preset with the fewest layers, one round of 2 requests."""
    chosen = ["--deployments", *deployments] if deployments else []
    report = main(["--device", "cpu", "--preset", "wide-512", "--prompt-tokens",
                   str(PROMPT_TOKENS), "--completion-tokens", str(COMPLETION_TOKENS),
                   "--requests", "2", "--rounds", "1", "--tally", *chosen, "--workdir",
                   str(tmp_path), "--json", str(tmp_path / "report.json")])
    # The preset's shape (tools/testbed/tiny_moe.py): 8 layers, 512 experts, top-8.
    assert report["routing"] == {"num_layers": 8, "top_k": 8, "num_experts": 512}
    assert (tmp_path / "report.json").is_file()
    [cell] = report["cells"]
    check_tally(cell["tally"], layers=8, completion=COMPLETION_TOKENS)
    for name, figures in cell["variants"].items():
        assert figures["cpu_s_per_request"] > 0 and figures["deployment_cpu"] > 0, name
    return cell


def check_row_bytes(cell: dict[str, Any], *variants: str) -> None:
    # uint16 rows in base64: 8 x 8 x 2 bytes per row, 4/3 of it on the wire.
    for name in variants:
        assert cell["per_row"][name]["bytes"] > 128, cell["per_row"][name]


@pytest.mark.e2e_full
def test_cpu_mode_runs_the_recommended_deployments(tmp_path: Path) -> None:
    """Colocated and rows over NIXL behind vllm-router, each against its off baseline:
    the procedure end to end in a few minutes (make e2e; make test checks its response
    and load checks on the hand-made responses above)."""
    cell = run_cpu_mode(tmp_path, "colocated", "rows-over-nixl")
    rows = {name: figures["rows_per_request"] for name, figures in cell["variants"].items()}
    assert rows == {"colocated off": 0, "colocated on": WITH_ROWS,
                    "colocated on, opted out": 0, "pd off (vllm-router)": 0,
                    "rows over NIXL (vllm-router)": WITH_ROWS}
    check_row_bytes(cell, "colocated on", "rows over NIXL (vllm-router)")
    assert set(cell["ratios"]) == {
        "colocated on / colocated off", "colocated on, opted out / colocated off",
        "rows over NIXL (vllm-router) / pd off (vllm-router)"}


@pytest.mark.e2e_full
def test_cpu_mode_runs_every_deployment(tmp_path: Path) -> None:
    """Colocated, P/D with rows over NIXL behind vllm-router, P/D with the proxy merge
    and the native offload tier, each against its off baseline (the Mooncake store's
    family: the e2e_store test below)."""
    cell = run_cpu_mode(tmp_path)
    variants = cell["variants"]
    rows = {name: figures["rows_per_request"] for name, figures in variants.items()}
    assert rows == {"colocated off": 0, "colocated on": WITH_ROWS,
                    "colocated on, opted out": 0, "pd off (vllm-router)": 0,
                    "rows over NIXL (vllm-router)": WITH_ROWS, "pd off (pdproxy)": 0,
                    "proxy merge (pdproxy)": WITH_ROWS, "native off": 0,
                    "native on, rows from 0": WITH_ROWS,
                    "native on, rows from P": COMPLETION_TOKENS - 1}
    check_offload_loads(variants, "native", PROMPT_TOKENS)
    check_row_bytes(cell, "colocated on", "rows over NIXL (vllm-router)",
                    "proxy merge (pdproxy)", "native on, rows from 0")
    assert set(cell["ratios"]) == {
        "colocated on / colocated off", "colocated on, opted out / colocated off",
        "rows over NIXL (vllm-router) / pd off (vllm-router)",
        "proxy merge (pdproxy) / pd off (pdproxy)",
        "rows over NIXL (vllm-router) / proxy merge (pdproxy)",
        "native on, rows from 0 / native off", "native on, rows from P / native off"}


def check_tally(tally: dict[str, Any], layers: int, completion: int) -> None:
    """Calls per request of the rows path's functions, derived by hand: a colocated
    request runs 1 prefill and C - 1 decode forwards, each capturing every MoE layer
    once, and encodes its rows once; with rows over NIXL decode clears, reads and
    checks the slots once per request and only decode's response carries rows; with
    the proxy merge both responses carry rows and the proxy merges them once."""
    def calls(variant: str, function: str) -> float:
        return tally[variant]["functions"].get(function, {}).get("calls_per_request", 0)

    capture = ("vllm.model_executor.layers.fused_moe.routed_experts_capturer:"
               "RoutedExpertsCapturer.capture")
    encode = "vllm.utils.serial_utils:numpy2base64"
    rows_read = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.rows_transfer:"
    merge = "vllm_r3_pdproxy.server:merge_response"
    assert calls("colocated on", capture) == layers * completion
    assert calls("colocated on", encode) == 1
    for function in ("clear_landing_slots", "post_read", "failed_blocks"):
        assert calls("rows over NIXL (vllm-router)", rows_read + "NixlRowsTransfer."
                     + function) == 1, function
    assert calls("rows over NIXL (vllm-router)", encode) == 1
    assert calls("rows over NIXL (vllm-router)", merge) == 0
    if "proxy merge (pdproxy)" in tally:  # the family was run
        assert calls("proxy merge (pdproxy)", encode) == 2
        assert calls("proxy merge (pdproxy)", merge) == 1
        assert calls("proxy merge (pdproxy)", rows_read + "NixlRowsTransfer.post_read") == 0
    for variant, figures in tally.items():
        assert figures["missing"] == [], variant


def check_offload_loads(variants: dict[str, Any], kind: str, prompt: int) -> None:
    """Each request is sent twice: the first computes its 40 prompt tokens, the second
    loads the one full 32-token block of them (the last prompt token is always
    computed), so the server left 32 / 2 = 16 prompt tokens per request uncomputed."""
    for name in (f"{kind} off", f"{kind} on, rows from 0", f"{kind} on, rows from P"):
        assert variants[name]["cached_per_request"] == (prompt - 1) // 32 * 32 / 2, name


@pytest.mark.e2e_store
def test_cpu_mode_runs_the_mooncake_store(tmp_path) -> None:
    """The Mooncake store's family (make e2e, which installs the store)."""
    prompt, completion = 40, 3
    report = main(["--device", "cpu", "--preset", "wide-512", "--prompt-tokens",
                   str(prompt), "--completion-tokens", str(completion), "--requests", "2",
                   "--rounds", "1", "--deployments", "offload-mooncake", "--workdir",
                   str(tmp_path)])
    [cell] = report["cells"]
    rows = {name: figures["rows_per_request"] for name, figures in cell["variants"].items()}
    assert rows == {"mooncake off": 0, "mooncake on, rows from 0": prompt + completion - 1,
                    "mooncake on, rows from P": completion - 1}
    check_offload_loads(cell["variants"], "mooncake", prompt)
    assert set(cell["ratios"]) == {"mooncake on, rows from 0 / mooncake off",
                                   "mooncake on, rows from P / mooncake off"}


def test_no_two_rounds_share_a_first_block() -> None:
    """The prompts of one index share their leading tokens across lengths (a 1,024-token
    prompt starts with the 64-token one); the salt makes every round's first 32-token
    block its own, across lengths too, so no round hits a block another round cached."""
    first_blocks = {}
    for batch, length in enumerate((64, 256, 1024, 64, 256)):
        for index, prompt in enumerate(prompts(3, length)):
            block = tuple(salted(prompt, batch)[:32])
            assert block not in first_blocks, (batch, index, first_blocks.get(block))
            first_blocks[block] = (batch, index)
    # Negative control: without the salt the 64- and 256-token prompts share blocks.
    assert prompts(1, 64)[0][:32] == prompts(1, 256)[0][:32]
    assert salted([9, 9, 9], 508 * 3 + 7)[:2] == [7, 11]
    with pytest.raises(ValueError, match="does not fit"):
        salted([9, 9, 9], 508 * 508)


def test_cycles_reverse_the_deployment_order() -> None:
    """A B C, then C B A: each deployment's mean position in the run is the same."""
    assert deployment_order(["off", "transfer", "splice"], 2) == [
        (0, "off"), (0, "transfer"), (0, "splice"),
        (1, "splice"), (1, "transfer"), (1, "off")]
    assert deployment_order(["a", "b"], 3) == [
        (0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert deployment_order(["a", "b"], 1) == [(0, "a"), (0, "b")]


def spent(cpu_s: float, requests: int, cycle: int) -> RoundResult:
    """A round whose deployment spent `cpu_s` over `requests` requests, client idle."""
    return RoundResult(CpuUse({"decode": cpu_s}, {}), 0.0, 1.0, requests, 0, 0, 0,
                       cycle=cycle)


def test_ratios_are_taken_within_each_cycle() -> None:
    """Medians per cycle, divided: cycle 0 has 6 and 8 s per request against 4 (ratio
    7 / 4), cycle 1 has 3 against 2 and 4 (3 / 3); a cycle one side lacks is left
    out."""
    top = [spent(12.0, 2, 0), spent(16.0, 2, 0), spent(6.0, 2, 1), spent(9.0, 1, 2)]
    bottom = [spent(8.0, 2, 0), spent(4.0, 2, 1), spent(8.0, 2, 1)]
    assert cycle_ratios(top, bottom) == [7 / 4, 1.0]
    assert cycle_ratios(top, []) == []


@pytest.mark.parametrize("nice", ["-1", "20"])
def test_spinner_nice_outside_0_to_19_is_refused(
    nice: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--spinner-nice", nice])
    assert f"--spinner-nice must be 0-19 (0: as they start), got {nice}" in (
        capsys.readouterr().err)


class _Refused(Exception):
    pass


@pytest.mark.parametrize(("argv", "nice"), [([], 19), (["--spinner-nice", "0"], 0)])
def test_spinner_nice_reaches_the_pd_cluster(
    argv: list[str], nice: int, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tools.e2e.cluster

    specs: list[Any] = []

    def cluster(spec: Any, logs: Any) -> None:
        specs.append(spec)
        raise _Refused

    monkeypatch.setattr(tools.e2e.cluster, "Cluster", cluster)
    args = parse_args(["--device", "cpu", *argv])
    target = Target("cpu", str(tmp_path), Routing(2, 2, 8), (), 1, tmp_path,
                    spinner_nice=args.spinner_nice)
    with pytest.raises(_Refused):
        start_pd(target, "rows-over-nixl", ["vllm-router"])
    assert specs[0].spinner_nice == nice and specs[0].routed_experts_transfer


def test_cycles_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--preset", "wide-512", "--cycles", "0"])
    assert "--cycles must be at least 1, got 0" in capsys.readouterr().err


def test_the_p_d_families_old_names_still_work_and_warn(
    capsys: pytest.CaptureFixture[str],
) -> None:
    preferred = parse_args(["--device", "cpu", "--deployments", "rows-over-nixl",
                            "proxy-merge"])
    assert preferred.deployments == ["rows-over-nixl", "proxy-merge"]
    assert capsys.readouterr().err == ""
    old = parse_args(["--device", "cpu", "--deployments", "pd-transfer", "pd-splice"])
    assert old.deployments == preferred.deployments
    assert capsys.readouterr().err.splitlines() == [
        "python -m benchmarks.gpu.r3_cost: --deployments pd-transfer is deprecated; "
        "use --deployments rows-over-nixl",
        "python -m benchmarks.gpu.r3_cost: --deployments pd-splice is deprecated; "
        "use --deployments proxy-merge"]
