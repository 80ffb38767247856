"""Malformed bodies between client, proxy and servers, over HTTP.

Two scripted backends stand in for prefill and decode; the proxy under test is the
real aiohttp app. Each case plants one malformed body and checks the status and that
the message names the field; then the same proxy serves a good request whose merged
rows equal the hand-built ones (the proxy keeps serving, and the good path is the
negative control of every case).

Rows are distinguishable: position p holds p in every slot (3 layers, top-2).
"""

from __future__ import annotations

import asyncio
import base64
import io
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from vllm_r3_pdproxy.merge import decode_npy, encode_npy
from vllm_r3_pdproxy.server import Backends, make_app

PROMPT, COMPLETION = 6, 4  # rows cover [0, P + C - 1) = [0, 9)
KV_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-engine",
    "remote_block_ids": [1],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
}


def rows(start: int, end: int, dtype: type = np.uint8) -> np.ndarray:
    values = np.arange(start, end).astype(dtype)
    return np.broadcast_to(values[:, None, None], (end - start, 3, 2)).copy()


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def good_prefill() -> dict[str, Any]:
    return {
        "choices": [
            {
                "index": 0,
                "token_ids": [40],
                "routed_experts": encode_npy(rows(0, PROMPT)),
                "routed_experts_start": 0,
            }
        ],
        "kv_transfer_params": dict(KV_PARAMS),
        "usage": {"prompt_tokens": PROMPT},
    }


def good_decode() -> dict[str, Any]:
    return {
        "choices": [
            {
                "index": 0,
                "token_ids": [40, 41, 42, 43],
                "routed_experts": encode_npy(rows(PROMPT - 1, PROMPT + COMPLETION - 1)),
                "routed_experts_start": PROMPT - 1,
            }
        ],
        "usage": {"prompt_tokens": PROMPT},
    }


def set_choice(response: dict[str, Any], **fields: Any) -> dict[str, Any]:
    response["choices"][0].update(fields)
    return response


def without(response: dict[str, Any], *path: str | int) -> dict[str, Any]:
    target = response
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return response


Answer = Callable[[], web.Response | Any]

CLIENT_BODY = {"model": "tiny", "prompt": [4, 5, 6, 7, 8, 9], "max_tokens": COMPLETION}


async def exchange(
    prefill: Answer, decode: Answer, body: Any, timeout_s: float = 30.0
) -> tuple[int, dict[str, Any], int, dict[str, Any], int]:
    """One bad request, then one good one through the same proxy.

    Returns (status, json) of each and how many requests the backends saw.
    """
    script = {"prefill": prefill, "decode": decode}
    seen = {"count": 0}

    def backend(role: str) -> web.Application:
        async def answer(request: web.Request) -> web.StreamResponse:
            seen["count"] += 1
            out = script[role]()
            if asyncio.iscoroutine(out):
                out = await out
            return (
                out if isinstance(out, web.StreamResponse) else web.json_response(out)
            )

        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        return app

    async with (
        TestServer(backend("prefill")) as prefill_server,
        TestServer(backend("decode")) as decode_server,
    ):
        backends = Backends(
            [str(prefill_server.make_url("")).rstrip("/")],
            [str(decode_server.make_url("")).rstrip("/")],
        )
        async with TestClient(
            TestServer(make_app(backends, timeout_s=timeout_s))
        ) as client:
            if isinstance(body, bytes):
                bad = await client.post("/v1/completions", data=body)
            else:
                bad = await client.post("/v1/completions", json=body)
            bad_json = await bad.json()
            bad_seen = seen["count"]
            script.update(prefill=good_prefill, decode=good_decode)
            good = await client.post("/v1/completions", json=CLIENT_BODY)
            return bad.status, bad_json, good.status, await good.json(), bad_seen


def run_case(prefill: Answer, decode: Answer, body: Any = None, **kw: Any) -> tuple:
    status, answer, good_status, good, seen = asyncio.run(
        exchange(prefill, decode, CLIENT_BODY if body is None else body, **kw)
    )
    # The proxy keeps serving: the next request is merged, rows [0, 9) by position.
    assert good_status == 200, good
    merged = decode_npy(good["choices"][0]["routed_experts"], "merged")
    np.testing.assert_array_equal(merged, rows(0, PROMPT + COMPLETION - 1))
    assert good["choices"][0]["routed_experts_start"] == 0
    return status, answer["error"]["message"], seen


def test_the_good_exchange_is_merged() -> None:
    """Negative control for the cases below: both bad and good request are good."""
    status, answer, _, _, seen = asyncio.run(
        exchange(good_prefill, good_decode, CLIENT_BODY)
    )
    assert status == 200 and seen == 2
    merged = decode_npy(answer["choices"][0]["routed_experts"], "merged")
    np.testing.assert_array_equal(merged, rows(0, 9))


def truncated() -> str:
    return base64.b64encode(npy_bytes(rows(5, 9))[:-4]).decode()


DECODE_CASES = {
    "not JSON": (
        lambda: web.Response(text="<html>busy</html>"),
        r"decode server .* answered HTTP 200 with a body that is not JSON",
    ),
    "a JSON array": (lambda: [1, 2], "answered HTTP 200 with a JSON list"),
    "no choices": (
        lambda: without(good_decode(), "choices"),
        "decode response choices must be an array of objects, got NoneType",
    ),
    "no token_ids": (
        lambda: without(good_decode(), "choices", 0, "token_ids"),
        "decode choice 0 has no token_ids array",
    ),
    "no prompt length": (
        lambda: without(good_decode(), "usage"),
        "neither prompt_token_ids nor an integer usage.prompt_tokens",
    ),
    "truncated npy": (
        lambda: set_choice(good_decode(), routed_experts=truncated()),
        r"holds 20 data bytes, but its header says shape \(4, 3, 2\)",
    ),
    "float rows": (
        lambda: set_choice(
            good_decode(), routed_experts=encode_npy(rows(5, 9, np.float32))
        ),
        "decode routed_experts has dtype float32; expected uint8 or uint16",
    ),
    "other layer count": (
        lambda: set_choice(
            good_decode(), routed_experts=encode_npy(np.zeros((4, 2, 2), np.uint8))
        ),
        r"cannot concatenate routed_experts with shapes \(6, 3, 2\) and \(4, 2, 2\)",
    ),
    "no start": (
        lambda: without(good_decode(), "choices", 0, "routed_experts_start"),
        "decode routed_experts_start must be a non-negative integer, got None",
    ),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_a_malformed_decode_answer_is_502_naming_the_field(case: str) -> None:
    answer, message = DECODE_CASES[case]
    status, text, _ = run_case(good_prefill, answer)
    assert status == 502
    assert re.search(message, text), text


def test_a_prefill_answer_without_kv_transfer_params_is_502() -> None:
    status, text, seen = run_case(
        lambda: without(good_prefill(), "kv_transfer_params"), good_decode
    )
    assert status == 502
    assert "returned no kv_transfer_params" in text
    assert seen == 1  # decode was never asked


def test_a_backend_refusal_keeps_its_status_and_message() -> None:
    refusal = {"error": {"message": "routed_experts_prompt_start must be between"}}
    status, text, seen = run_case(
        lambda: web.json_response(refusal, status=400), good_decode
    )
    assert status == 400 and seen == 1
    assert "prefill server" in text and "routed_experts_prompt_start" in text


@pytest.mark.parametrize("start", [-1, "3", 2.5, True, None])
def test_a_bad_prompt_start_is_400_before_any_backend(start: Any) -> None:
    status, text, seen = run_case(
        good_prefill, good_decode, CLIENT_BODY | {"routed_experts_prompt_start": start}
    )
    assert status == 400 and seen == 0
    assert (
        f"routed_experts_prompt_start must be a non-negative integer, got {start!r}"
        in text
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [(b"{not json", "request body is not JSON"), ([1], "must be a JSON object")],
)
def test_a_bad_client_body_is_400(body: Any, message: str) -> None:
    status, text, seen = run_case(good_prefill, good_decode, body)
    assert status == 400 and seen == 0
    assert message in text


def test_a_backend_that_does_not_answer_in_time_is_504() -> None:
    # The good request after it shares the timeout: 3 s leaves room for a loaded
    # machine (a 1 s timeout failed it while e2e servers held both cores).
    async def slow() -> dict[str, Any]:
        await asyncio.sleep(8)
        return good_decode()

    status, text, _ = run_case(good_prefill, slow, timeout_s=3.0)
    assert status == 504
    assert "did not answer within 3 s" in text and "--timeout" in text
