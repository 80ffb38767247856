"""End to end: sampling replay beside routed experts under P/D, rows over NIXL.

RL teams validate a P/D deployment by requiring every output a trainer replays
(tokens, routed-experts rows, sampling masks and processed logprobs) to equal
colocated serving. Prefill and decode `vllm serve` instances joined by
NixlConnector, both with the rows-transfer switch, routed experts and
`--return-sampling-mask --logprobs-mode processed_logprobs`, are driven on
/inference/v1/generate by a client that carries `kv_transfer_params` itself (the
endpoint takes and returns them); a colocated `vllm serve` with the same flags
answers the same seeded, non-greedy request (temperature, top_p and top_k), alone
and as a group of n = 2 (prefilled once, one hand-off, read once). The reference is
the colocated answer: P/D must not change any of the four, for any choice.

The planted-fault control (E2E_FAULT=no-row-transfer: decode skips the rows READ)
runs this file in a separate run: tests/v1/kv_connector/test_pd_sampling_mask_control.py.
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

GENERATE = "/inference/v1/generate"
NUM_EXPERTS, ROUTER_TOP_K = 8, 2
PROMPT = [11, 27, 301, 45, 45, 160, 7, 499, 23, 88, 64, 250, 3, 19, 77, 410, 35,
          90, 12, 200, 31, 48, 5, 66, 120, 17, 3, 9, 250, 41, 33, 8, 71, 99]
GROUP = 2
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 5, "seed": 7, "n": 1,
            "max_tokens": 8, "logprobs": 3}
SERVE_ARGS = (*CPU_SERVE_ARGS, "--enable-scale-out", "--return-sampling-mask",
              "--logprobs-mode", "processed_logprobs")


def _body(**sampling: object) -> dict:
    return {"model": "tiny", "token_ids": PROMPT,
            "sampling_params": SAMPLING | sampling}


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, dict]]:
    model = tmp_path_factory.mktemp("tiny-moe")
    build(model, num_experts=NUM_EXPERTS, num_experts_per_tok=ROUTER_TOP_K, seed=0)
    spec = ClusterSpec(model, serve_args=SERVE_ARGS, routed_experts_transfer=True,
                       router="vllm-router", fault=os.environ.get("E2E_FAULT"))
    out: dict[str, tuple[int, dict]] = {}
    with Cluster(spec, logs=tmp_path_factory.mktemp("logs")) as cluster:
        servers = cluster.servers
        out["reference"] = post_json(servers["reference"].url, GENERATE, _body())
        # A hand-off as a P/D client sends it: prefill computes the prompt and
        # one token, decode pulls the KV (and the rows) and samples the answer.
        out["prefill"] = post_json(servers["prefill"].url, GENERATE, _body(max_tokens=1) | {
            "kv_transfer_params": dict(PREFILL_KV_PARAMS)})
        handoff = out["prefill"][1].get("kv_transfer_params")
        out["decode"] = post_json(servers["decode"].url, GENERATE, _body() | {
            "kv_transfer_params": handoff})
        # An RL group: prefill computes the prompt once whatever n asks.
        group = {"n": GROUP, "seed": 11}
        out["reference-group"] = post_json(servers["reference"].url, GENERATE,
                                           _body(**group))
        prefill = post_json(servers["prefill"].url, GENERATE, _body(**group, max_tokens=1)
                            | {"kv_transfer_params": dict(PREFILL_KV_PARAMS)})
        out["decode-group"] = post_json(servers["decode"].url, GENERATE, _body(**group) | {
            "kv_transfer_params": prefill[1].get("kv_transfer_params")})
    return out


def _choices(answers: dict, name: str) -> list[dict]:
    status, body = answers[name]
    assert status == 200, (name, body)
    return sorted(body["choices"], key=lambda choice: choice["index"])


def _choice(answers: dict, name: str) -> dict:
    (choice,) = _choices(answers, name)
    return choice


def _pairs(answers: dict) -> list[tuple[dict, dict]]:
    """Every decode choice with the reference's: the single request's, then each of
    the group's."""
    group = list(zip(_choices(answers, "decode-group"),
                     _choices(answers, "reference-group"), strict=True))
    assert len(group) == GROUP
    return [(_choice(answers, "decode"), _choice(answers, "reference")), *group]


def test_the_hand_off_carries_kv_transfer_params_and_no_rows(answers: dict) -> None:
    status, body = answers["prefill"]
    assert status == 200, body
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"], params
    # Rows over NIXL: the prompt's rows travel with the KV, not in this response.
    assert body["choices"][0]["routed_experts"] is None


def test_decode_samples_the_tokens_colocated_serving_samples(answers: dict) -> None:
    for decode, reference in _pairs(answers):
        assert len(reference["token_ids"]) == SAMPLING["max_tokens"]
        assert decode["token_ids"] == reference["token_ids"]


def test_decode_returns_every_row_colocated_serving_returns(answers: dict) -> None:
    for decode, reference in _pairs(answers):
        assert decode["routed_experts_start"] == reference["routed_experts_start"] == 0
        rows, expected = choice_rows(decode), choice_rows(reference)
        assert expected.shape == (
            len(PROMPT) + SAMPLING["max_tokens"] - 1, 2, ROUTER_TOP_K)
        assert rows.dtype == expected.dtype and np.array_equal(rows, expected)


def test_decode_returns_the_sampling_masks_colocated_serving_returns(
    answers: dict,
) -> None:
    for decode, reference in _pairs(answers):
        masks = reference["sampling_mask"]
        assert len(masks) == SAMPLING["max_tokens"]
        for token, support in zip(reference["token_ids"], masks):
            assert token in support and len(support) <= SAMPLING["top_k"]
        assert decode["sampling_mask"] == masks


def test_decode_returns_the_processed_logprobs_colocated_serving_returns(
    answers: dict,
) -> None:
    for decode, reference in _pairs(answers):
        got, want = decode["logprobs"]["content"], reference["logprobs"]["content"]
        assert len(want) == SAMPLING["max_tokens"]
        for a, b in zip(got, want):
            assert a["token"] == b["token"]
            # float32 on CPU: the pulled KV equals what decode would compute; the
            # sums may round in another order.
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
            assert [t["token"] for t in a["top_logprobs"]] == [
                t["token"] for t in b["top_logprobs"]]
