"""Faults under Ray Serve LLM 2.60.0's own P/D app (`build_pd_openai_app`) serving
the fork on a local multi-node Ray cluster on CPU (head, prefill raylet, decode
raylet; docs/deployments/ray-serve.md, "Faults"): a prefill replica added while a
client sends requests, the decode replica's engine killed, the decode node's raylet
killed and replaced, the prefill node's raylet killed and replaced, and after each a
drain check on the engines' own metrics as Ray exports them.

Whatever a fault costs, an answer with HTTP 200 must carry rows and tokens equal to
a colocated `vllm serve`'s, and once Ray reports the deployment healthy again every
prompt must be served equal. One cluster serves every fault in turn
(`tools.testbed.ray_serve_faults.run_faults`), once for the module; the tests below
read its report. Needs Ray Serve beside the fork (tools/setup-ray-serve-env.sh;
`make e2e-ray-serve` runs this file and test_ray_serve_pd_e2e.py). About 30 minutes
on 2 cores.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tools.testbed import ray_serve_faults as faults
from tools.testbed import ray_serve_pd
from tools.testbed.tiny_moe import build

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_full, pytest.mark.ray_serve,
              pytest.mark.timeout(4800)]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ray_serve_pd.require_ray_serve()
    model = tmp_path_factory.mktemp("tiny-moe")
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    workdir = tmp_path_factory.mktemp("faults")
    bodies = [ray_serve_pd.request_body(p) for p in ray_serve_pd.prompts()]
    reference = ray_serve_pd.reference_answers(model, bodies, workdir)
    out = workdir / "faults.json"
    return faults.run_faults(workdir, model, reference, prefill_raylet=True,
                             on_step=lambda r: out.write_text(json.dumps(r, indent=1)))


def step(report: dict[str, Any], name: str) -> dict[str, Any]:
    assert name in report, f"step {name} did not run: {sorted(report)}"
    assert "error" not in report[name], report[name]["error"]
    return report[name]


def test_no_answer_with_wrong_rows_or_tokens(report: dict[str, Any]) -> None:
    # Any 200, during a fault or after it, equals colocated.
    bad = {name: faults.wrong(r) for name, r in report.items()
           if isinstance(r, dict) and faults.wrong(r)}
    assert not bad, bad


def test_baseline_equal(report: dict[str, Any]) -> None:
    assert step(report, "baseline")["after"]["equal"] == 3, report["baseline"]


def test_prefill_replica_added_under_traffic_serves(report: dict[str, Any]) -> None:
    r = step(report, "scale_up_prefill")
    # Every request, during and after the scale-up, served and equal.
    for phase in ("during", "after"):
        assert r[phase]["equal"] == r[phase]["sent"] > 0, (phase, r[phase], r)
    # Only a replica was added: the first one kept its actor and process.
    assert r["first_replica_kept"], r
    # Both on the prefill raylet, and the new one served requests.
    assert [x["node"] for x in r["replicas_after"]] == ["prefill-node"] * 2, r
    assert r["new_replica"], r
    assert r["engine_served_by_replica"].get(r["new_replica"], 0) > 0, r
    assert r["served_by_replica"].get(r["new_replica"], 0) > 0, r


def test_killed_decode_engine_replaced_then_equal(report: dict[str, Any]) -> None:
    r = step(report, "kill_decode_engine")
    assert r["new_replica"]["replica_id"] != r["old_replica"]["replica_id"], r
    assert r["new_replica"]["node"] == "decode-node", r
    assert r["after"]["equal"] == r["after"]["sent"] == 3, r["after"]


@pytest.mark.parametrize("node", ["decode", "prefill"])
def test_killed_raylet_replaced_then_equal(report: dict[str, Any], node: str) -> None:
    r = step(report, f"kill_{node}_raylet")
    assert r["node_dead_after_s"] is not None, r  # Ray marked the node dead
    assert not {x["replica_id"] for x in r["new_replicas"]} & {
        x["replica_id"] for x in r["old_replicas"]}, r
    assert {x["node"] for x in r["new_replicas"]} == {f"{node}-node"}, r
    assert r["after"]["equal"] == r["after"]["sent"] == 3, r["after"]


@pytest.mark.parametrize("after", ["scale_up", "decode_engine", "decode_raylet",
                                   "prefill_raylet"])
def test_survivors_drained(report: dict[str, Any], after: str) -> None:
    # No request running or waiting on any live engine, decode's KV cache empty,
    # one engine-core process per replica.
    r = step(report, f"drained_after_{after}")
    assert r["replicas"], r
    assert r["leaked"] == [], r


def test_no_process_outlives_the_cluster(report: dict[str, Any]) -> None:
    assert report["processes_left_after_stop"] == [], report
