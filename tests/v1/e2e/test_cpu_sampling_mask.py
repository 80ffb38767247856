"""End to end: sampling masks beside routed experts on CPU (patches
`keep-the-sampling-mask-s-store-masks-boolean-under`, 0.31.0 only, and
`refuse-sampling-mask-requests-without-temperature`).

One real `vllm serve` with VLLM_CPU_TRITON_INTERPRET=1, routed experts and
`--return-sampling-mask --logprobs-mode processed_logprobs` answers seeded,
non-greedy requests on /inference/v1/generate. The independent reference for a
mask is transformers' float32 forward over the same tokens: with top_p = 1 the
support of a generated token is the top_k token ids of the logits at the
position before it (temperature scales the logits, it does not reorder them).
Where the top_k-th and next logits nearly tie, the served and the reference
forward may keep another id, so such positions are counted apart, as the router
oracle does for rows. Requests the mask cannot serve get a 400 naming the
field, and the engine keeps serving.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tools.testbed.cpu_server import VllmServer, cpu_env, npy_rows, post_json
from tools.testbed.router_oracle import check_rows, oracle_rows
from tools.testbed.tiny_moe import build

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NUM_EXPERTS, ROUTER_TOP_K = 8, 2
TOP_K, TEMPERATURE, SEED, N, MAX_TOKENS = 5, 0.8, 7, 2, 6
PROMPT = [11, 27, 301, 45, 45, 160, 7, 499, 23, 88, 64, 250, 3, 19, 77, 410, 35]
# float32 on both sides: only near-ties can differ (gaps measured on this model
# are above 1e-3 at most positions).
MARGIN = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe")
    build(path, num_experts=NUM_EXPERTS, num_experts_per_tok=ROUTER_TOP_K, seed=0)
    return path


def _body(**sampling: object) -> dict:
    params = {
        "temperature": TEMPERATURE,
        "top_p": 1.0,
        "top_k": TOP_K,
        "seed": SEED,
        "n": N,
        "max_tokens": MAX_TOKENS,
    }
    params.update(sampling)
    return {"model": "tiny", "token_ids": PROMPT, "sampling_params": params}


@pytest.fixture(scope="module")
def answers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    server = VllmServer(
        model=model_dir,
        log_path=log,
        extra_args=(
            "--dtype",
            "float32",
            "--enable-scale-out",
            "--enable-return-routed-experts",
            "--return-sampling-mask",
            "--logprobs-mode",
            "processed_logprobs",
        ),
        env=cpu_env(opt_in=True),
    )
    out = {}
    with server:
        generate = "/inference/v1/generate"
        out["first"] = post_json(server.url, generate, _body())
        out["greedy"] = post_json(server.url, generate, _body(temperature=0.0, n=1))
        out["no_top_k"] = post_json(server.url, generate, _body(top_k=0))
        out["again"] = post_json(server.url, generate, _body())
    return out


@torch.inference_mode()
def reference_supports(
    model_dir: Path, completion: list[int]
) -> tuple[list[list[int]], list[float]]:
    """Per generated token: transformers' top-TOP_K ids at the position before it,
    and the gap between the TOP_K-th and the next logit there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = torch.tensor([PROMPT + completion[:-1]])
    logits = model(input_ids=tokens, use_cache=False).logits[0, len(PROMPT) - 1 :]
    ordered, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    supports = [sorted(row[:TOP_K].tolist()) for row in ids]
    gaps = (ordered[:, TOP_K - 1] - ordered[:, TOP_K]).tolist()
    return supports, gaps


def test_every_choice_has_one_mask_row_per_token_holding_it(answers: dict) -> None:
    status, body = answers["first"]
    assert status == 200, body
    assert len(body["choices"]) == N
    for choice in body["choices"]:
        tokens, mask = choice["token_ids"], choice["sampling_mask"]
        assert len(tokens) == MAX_TOKENS and len(mask) == MAX_TOKENS
        for token, support in zip(tokens, mask):
            assert support == sorted(support) and token in support


def test_masks_equal_the_top_k_of_a_transformers_forward(
    answers: dict, model_dir: Path
) -> None:
    _, body = answers["first"]
    checked = 0
    for choice in body["choices"]:
        supports, gaps = reference_supports(model_dir, choice["token_ids"])
        for position, (got, want, gap) in enumerate(
            zip(choice["sampling_mask"], supports, gaps)
        ):
            if gap < MARGIN:
                continue
            assert got == want, (choice["index"], position, got, want, gap)
            checked += 1
    # Nearly every position is far from a tie: the comparison is not vacuous.
    assert checked >= N * MAX_TOKENS - 2, checked


def test_rows_come_back_beside_the_masks(answers: dict, model_dir: Path) -> None:
    _, body = answers["first"]
    for choice in body["choices"]:
        rows = npy_rows(choice["routed_experts"])
        start = choice["routed_experts_start"]
        assert start == 0
        assert rows.shape == (len(PROMPT) + MAX_TOKENS - 1, 2, ROUTER_TOP_K)
        oracle = oracle_rows(model_dir, PROMPT + choice["token_ids"], ROUTER_TOP_K)
        verdict = check_rows(rows, start, oracle, MARGIN)
        assert verdict.ok, verdict


@pytest.mark.parametrize(
    ("answer", "field"), [("greedy", "temperature"), ("no_top_k", "top_k")]
)
def test_a_request_the_mask_cannot_serve_gets_a_400_naming_the_field(
    answers: dict, answer: str, field: str
) -> None:
    status, body = answers[answer]
    assert status == 400, body
    message = body["error"]["message"]
    assert f"requires {field} > 0" in message and "--return-sampling-mask" in message


def test_the_engine_serves_the_same_answer_after_refusals(answers: dict) -> None:
    (status, first), (again_status, again) = answers["first"], answers["again"]
    assert (status, again_status) == (200, 200), again
    for a, b in zip(first["choices"], again["choices"]):
        assert a["token_ids"] == b["token_ids"]
        assert a["sampling_mask"] == b["sampling_mask"]
        assert np.array_equal(
            npy_rows(a["routed_experts"]), npy_rows(b["routed_experts"])
        )
