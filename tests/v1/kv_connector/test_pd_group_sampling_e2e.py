"""End to end: an RL group (n > 1) served through P/D, prefilled once, read once.

Prefill and decode `vllm serve` instances joined by NixlConnector, rows over
NIXL, behind the stock vllm-router (which forwards n to both roles), and the same
request driven by a client that carries `kv_transfer_params` itself on
/inference/v1/generate. A colocated `vllm serve` answers the same seeded,
non-greedy request with n = 3 (vLLM seeds child i with seed + i): every choice
must equal it (token ids, and rows from 0 to P + C - 1). Prefill runs one
sequence per hand-off, and decode reads each hand-off once: a group costs the
NIXL transfers of one n = 1 request of the same length, and nothing is left held
on either role afterwards.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from vllm_r3_pdproxy.endpoints import PREFILL_KV_PARAMS

from tools.e2e.cluster import Cluster
from tools.e2e.cluster_spec import CPU_SERVE_ARGS, ClusterSpec
from tools.testbed.cpu_server import choice_rows, post_json
from tools.testbed.tiny_moe import build

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_full, pytest.mark.timeout(1800)]

N = 3
NUM_EXPERTS, ROUTER_TOP_K = 8, 2
# 45 tokens: 32-token blocks, so the last prompt position (44) falls inside
# block 1, which each sibling copies. Each path gets its own prompt, so no path
# finds another's blocks in decode's prefix cache.
PROMPTS = {
    name: [(37 * i + 101 * k) % 480 + 11 for i in range(45)]
    for k, name in enumerate(("single", "router", "client"))
}
SAMPLING = {"temperature": 0.8, "top_k": 5, "seed": 7, "n": N, "max_tokens": 6}
NIXL_READS = "vllm:nixl_xfer_time_seconds_count"


def _completion(prompt: str, n: int = N) -> dict:
    return {"model": "tiny", "prompt": PROMPTS[prompt], "return_token_ids": True,
            **SAMPLING, "n": n}


def _generate(**sampling: object) -> dict:
    return {"model": "tiny", "token_ids": PROMPTS["client"],
            "sampling_params": SAMPLING | sampling}


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    model = tmp_path_factory.mktemp("tiny-moe")
    build(model, num_experts=NUM_EXPERTS, num_experts_per_tok=ROUTER_TOP_K, seed=0)
    spec = ClusterSpec(model, serve_args=(*CPU_SERVE_ARGS, "--enable-scale-out"),
                       routed_experts_transfer=True, router="vllm-router",
                       fault=os.environ.get("E2E_FAULT"))
    out: dict[str, object] = {}
    with Cluster(spec, logs=tmp_path_factory.mktemp("logs")) as cluster:
        servers = cluster.servers

        def reads() -> float:
            value = cluster.gauge("decode", NIXL_READS)
            assert value is not None, "decode's /metrics did not answer"
            return value

        before = reads()
        out["single"] = post_json(cluster.url, "/v1/completions",
                                  _completion("single", n=1))
        out["single_reads"] = reads() - before
        out["reference"] = post_json(servers["reference"].url, "/v1/completions",
                                     _completion("router"))
        before = reads()
        out["router"] = post_json(cluster.url, "/v1/completions", _completion("router"))
        out["router_reads"] = reads() - before
        out["reference_generate"] = post_json(servers["reference"].url,
                                              "/inference/v1/generate", _generate())
        out["prefill"] = post_json(servers["prefill"].url, "/inference/v1/generate",
                                   _generate(max_tokens=1) | {
                                       "kv_transfer_params": dict(PREFILL_KV_PARAMS)})
        handoff = out["prefill"][1].get("kv_transfer_params")
        before = reads()
        out["decode"] = post_json(servers["decode"].url, "/inference/v1/generate",
                                  _generate() | {"kv_transfer_params": handoff})
        out["client_reads"] = reads() - before
        out["held"] = cluster.gauge("prefill", "vllm:kv_transfer_held_requests")
        out["decode_usage"] = cluster.gauge("decode", "vllm:kv_cache_usage_perc")
        out["unrecognized"] = cluster.log_count("prefill", "unrecognized request")
    return out


def _choices(answers: dict, name: str) -> list[dict]:
    status, body = answers[name]
    assert status == 200, (name, body)
    choices = sorted(body["choices"], key=lambda choice: choice["index"])
    assert [choice["index"] for choice in choices] == list(range(N)), body
    return choices


@pytest.mark.parametrize(
    ("subject", "reference"),
    [("router", "reference"), ("decode", "reference_generate")],
    ids=["vllm-router", "client-driven"],
)
def test_every_choice_equals_colocated_serving(
    answers: dict, subject: str, reference: str
) -> None:
    got, want = _choices(answers, subject), _choices(answers, reference)
    # Seeded children sample different continuations: the test sees n answers.
    assert len({tuple(choice["token_ids"]) for choice in want}) > 1
    for mine, theirs in zip(got, want):
        assert mine["token_ids"] == theirs["token_ids"]
        assert len(theirs["token_ids"]) == SAMPLING["max_tokens"]
        rows, expected = choice_rows(mine), choice_rows(theirs)
        assert mine["routed_experts_start"] == theirs["routed_experts_start"] == 0
        assert expected.shape == (
            len(PROMPTS["router"]) + SAMPLING["max_tokens"] - 1, 2, ROUTER_TOP_K)
        assert np.array_equal(rows, expected)


def test_prefill_runs_one_sequence_per_hand_off(answers: dict) -> None:
    status, body = answers["prefill"]
    assert status == 200, body
    assert len(body["choices"]) == 1
    assert body["kv_transfer_params"]["do_remote_prefill"] is True


@pytest.mark.parametrize("path", ["router_reads", "client_reads"])
def test_a_group_costs_decode_the_transfers_of_one_request(
    answers: dict, path: str
) -> None:
    status, body = answers["single"]
    assert status == 200 and len(body["choices"]) == 1, body
    # One READ of the KV, one of the rows' slots (rows over NIXL).
    assert answers["single_reads"] >= 1
    assert answers[path] == answers["single_reads"]


def test_nothing_is_held_and_nobody_notifies_twice(answers: dict) -> None:
    assert answers["held"] == 0
    assert answers["decode_usage"] == 0
    # Prefill logs a notification for a request it no longer holds.
    assert answers["unrecognized"] == 0
