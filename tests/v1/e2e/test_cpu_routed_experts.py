"""End to end: the fork serves a tiny MoE on CPU with routed experts on (patch
`run-model-runner-v2-through-triton-s-interpreter`).

One real `vllm serve` with VLLM_CPU_TRITON_INTERPRET=1 answers greedy
completions; every response's rows are checked for shape, dtype and id range,
and compared with the router top-k that transformers computes on the same
weights for the same tokens. Without the opt-in, the stock refusal must appear.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tools.testbed.cpu_server import VllmServer, cpu_env, npy_rows
from tools.testbed.router_oracle import oracle_rows
from tools.testbed.tiny_moe import build, word

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NUM_EXPERTS, TOP_K, LAYERS = 8, 2, 2
# Prompt lengths around the 16-token KV block: inside one block, exactly one,
# across two. The server's very first forward is a 1-token prompt: on AMX machines
# that used to kill the worker with SIGILL unless a larger request came first
# (tests/v1/worker/test_cpu_amx_permission.py); nothing here warms the server up.
PROMPT_LENGTHS = (1, 5, 16, 17, 37)
MAX_TOKENS = 5
PROMPT_START = 20  # mid-block, inside the cached prefix of the 37-token prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe")
    build(path, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, seed=0)
    return path


@pytest.fixture(scope="module")
def responses(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    server = VllmServer(
        model=model_dir,
        log_path=log,
        extra_args=("--enable-return-routed-experts", "--dtype", "float32"),
        env=cpu_env(opt_in=True),
    )
    with server:
        out = [
            server.complete(_body(length))["choices"][0] for length in PROMPT_LENGTHS
        ]
        # The longest prompt again, rows from PROMPT_START on: a prefix-cache hit, so
        # the earlier rows come from the aux-output store.
        body = _body(PROMPT_LENGTHS[-1]) | {"routed_experts_prompt_start": PROMPT_START}
        out.append(server.complete(body)["choices"][0])
    return out


def _body(length: int) -> dict:
    prompt = " ".join(word(4 + (7 * i + length) % 500) for i in range(length))
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }


def hf_router_topk(model_dir: Path, token_ids: list[int]) -> np.ndarray:
    """Router top-k ids from transformers, shape (len(token_ids), layers, top_k)."""
    return oracle_rows(model_dir, token_ids, TOP_K).topk


def mismatched_rows(got: np.ndarray, want: np.ndarray) -> list[int]:
    """Positions whose expert sets differ in any layer (the order within top-k is
    not API)."""
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    same = (
        np.sort(got.astype(np.int64), -1) == np.sort(want.astype(np.int64), -1)
    ).all(axis=(1, 2))
    return [int(i) for i in np.flatnonzero(~same)]


def test_rows_have_the_documented_shape_dtype_and_range(responses: list[dict]) -> None:
    for length, choice in zip(PROMPT_LENGTHS, responses):
        rows = npy_rows(choice["routed_experts"])
        assert len(choice["prompt_token_ids"]) == length
        assert len(choice["token_ids"]) == MAX_TOKENS
        assert choice["routed_experts_start"] == 0
        assert rows.shape == (length + MAX_TOKENS - 1, LAYERS, TOP_K)
        assert rows.dtype == np.uint8
        assert rows.max() < NUM_EXPERTS
        distinct = np.sort(rows, axis=-1)
        assert (distinct[..., 1:] != distinct[..., :-1]).all(), (
            "an expert id repeats within top-k"
        )


def test_prompt_start_rows_are_labelled_and_equal_the_full_rows(
    responses: list[dict],
) -> None:
    full, partial = responses[len(PROMPT_LENGTHS) - 1], responses[-1]
    assert partial["token_ids"] == full["token_ids"]
    assert partial["routed_experts_start"] == PROMPT_START
    rows = npy_rows(partial["routed_experts"])
    assert rows.shape[0] == PROMPT_LENGTHS[-1] + MAX_TOKENS - 1 - PROMPT_START
    np.testing.assert_array_equal(rows, npy_rows(full["routed_experts"])[PROMPT_START:])


def test_rows_equal_transformers_router_topk(
    model_dir: Path, responses: list[dict]
) -> None:
    for choice in responses[: len(PROMPT_LENGTHS)]:
        rows = npy_rows(choice["routed_experts"])
        prompt = choice["prompt_token_ids"]
        # Row i is the routing of the token at position i; the last sampled token
        # has no row.
        forwarded = prompt + choice["token_ids"][:-1]
        want = hf_router_topk(model_dir, forwarded)
        # Prompt positions are a single batched forward in both: they must agree
        # exactly.
        assert mismatched_rows(rows[: len(prompt)], want[: len(prompt)]) == []
        # Decode positions run one token at a time in vLLM; allow no more than one
        # near-tie flip in bf16, and report which.
        flips = mismatched_rows(rows[len(prompt) :], want[len(prompt) :])
        assert len(flips) <= 1, f"decode rows differ from transformers at {flips}"


def test_comparison_catches_planted_faults(
    model_dir: Path, responses: list[dict]
) -> None:
    """Negative control: rows shifted by one position, or with layers swapped,
    must not pass."""
    choice = responses[len(PROMPT_LENGTHS) - 1]
    rows = npy_rows(choice["routed_experts"])
    prompt = choice["prompt_token_ids"]
    want = hf_router_topk(model_dir, prompt)[: len(prompt)]
    shifted = np.concatenate(
        [rows[1 : len(prompt)], rows[len(prompt) - 1 : len(prompt)]]
    )
    assert len(mismatched_rows(shifted, want)) > len(prompt) // 2
    swapped = rows[: len(prompt), ::-1, :]
    assert len(mismatched_rows(swapped, want)) > len(prompt) // 2


def test_without_the_opt_in_stock_refuses(model_dir: Path, tmp_path: Path) -> None:
    env = cpu_env(opt_in=False)
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    server = VllmServer(
        model=model_dir,
        log_path=tmp_path / "serve.log",
        extra_args=("--enable-return-routed-experts",),
        env=env,
    )
    server.start()
    try:
        code = server.wait_exit(timeout=300)
    finally:
        server.stop()
    assert code != 0
    log = server.log_path.read_text()
    # Stock's refusal: Model Runner V2's up to vLLM 0.33; from 0.34.0 on, the x86
    # CPU platform's own (it requires triton-cpu).
    assert (
        "Model Runner V2 requires Triton." in log
        or "vLLM on x86 CPUs requires Triton (triton-cpu)." in log
    ), log[-2000:]
