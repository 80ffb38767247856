"""The proxy on every endpoint, streamed and not.

Scripted backends stand in for prefill and decode and record what they were sent;
the proxy under test is the real aiohttp app. Rows are distinguishable: position p
holds p in every slot (2 layers, top-2), so a merged array equal to rows(s, P + C - 1)
proves each position came from the right side.

Expected values are hand-derived: P = 6 prompt tokens, C = 4 completion tokens, so a
client that asks for rows from s gets rows(s, 9); prefill returns rows(s, 6) and decode
rows(5, 9) (its first forward is P - 1).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from vllm_r3_pdproxy.merge import decode_npy, encode_npy
from vllm_r3_pdproxy.server import Backends, make_app
from vllm_r3_pdproxy.stream import sse_lines

PROMPT, COMPLETION = 6, 4
TOKENS = [40, 41, 42, 43]
KV_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [1]}
GENERATE = "/inference/v1/generate"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", GENERATE)


def rows(start: int, end: int) -> np.ndarray:
    values = np.arange(start, end).astype(np.uint8)
    return np.broadcast_to(values[:, None, None], (end - start, 2, 2)).copy()


def client_body(path: str, start: int, stream: bool, n: int = 1) -> dict[str, Any]:
    sampling = {"max_tokens": COMPLETION, "n": n, "routed_experts_prompt_start": start}
    if path == GENERATE:
        return {"token_ids": list(range(4, 4 + PROMPT)), "sampling_params": sampling,
                "stream": stream}
    prompt = {"prompt": list(range(4, 4 + PROMPT))} if path == "/v1/completions" \
        else {"messages": [{"role": "user", "content": "w4 w5"}]}
    return {"model": "tiny", **prompt, **sampling, "stream": stream}


def prefill_answer(start: int) -> dict[str, Any]:
    choice = {"index": 0, "token_ids": [40], "finish_reason": "length"}
    if start < PROMPT:
        choice |= {"routed_experts": encode_npy(rows(start, PROMPT)),
                   "routed_experts_start": start}
    return {"choices": [choice], "kv_transfer_params": KV_PARAMS,
            "usage": {"prompt_tokens": PROMPT}}


def decode_choice(index: int, decode_rows: np.ndarray | None = None,
                  start: int = PROMPT - 1) -> dict[str, Any]:
    rows_ = rows(PROMPT - 1, PROMPT + COMPLETION - 1) if decode_rows is None else decode_rows
    return {"index": index, "token_ids": TOKENS, "finish_reason": "length",
            "routed_experts": encode_npy(rows_), "routed_experts_start": start}


def decode_answer(start: int = 0) -> dict[str, Any]:
    """Decode's rows begin at its first forward, P - 1, or at the start if later."""
    first = max(start, PROMPT - 1)
    return {"choices": [decode_choice(0, rows(first, PROMPT + COMPLETION - 1), first)],
            "usage": {"prompt_tokens": PROMPT}}


def stream_events(n: int = 1, final: dict[str, Any] | None = None,
                  early_rows: bool = False) -> list[dict[str, Any]]:
    """One chunk per token and choice; the final chunk of each choice carries its rows."""
    events: list[dict[str, Any]] = []
    for i in range(n):
        for k, token in enumerate(TOKENS):
            choice: dict[str, Any] = {"index": i, "token_ids": [token],
                                      "finish_reason": None}
            if k == 0 and early_rows:
                choice["routed_experts"] = encode_npy(rows(5, 6))
            if k == len(TOKENS) - 1:
                last = dict(final or decode_choice(i))
                last["token_ids"] = [token]
                choice = last | {"index": i}
            events.append({"choices": [choice], **({"prompt_token_ids": [4]} if k == 0
                                                    else {})})
    return events


def sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) \
        + b"data: [DONE]\n\n"


class Scripted:
    """Both backends: what each answers and every body each was sent."""

    def __init__(self, prefill: Any, decode: Any) -> None:
        self.answers = {"prefill": prefill, "decode": decode}
        self.sent: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}

    def app(self, role: str) -> web.Application:
        async def answer(request: web.Request) -> web.StreamResponse:
            self.sent[role].append(await request.json())
            out = self.answers[role]
            if isinstance(out, bytes):
                return web.Response(body=out, content_type="text/event-stream")
            if isinstance(out, web.Response):
                return out
            return web.json_response(out)

        app = web.Application()
        for path in ENDPOINTS:
            app.router.add_post(path, answer)
        return app


async def _post(script: Scripted, path: str, body: Any) -> tuple[int, bytes]:
    async with (TestServer(script.app("prefill")) as p, TestServer(script.app("decode")) as d):
        backends = Backends([str(p.make_url("")).rstrip("/")],
                            [str(d.make_url("")).rstrip("/")])
        async with TestClient(TestServer(make_app(backends))) as client:
            resp = await client.post(path, json=body)
            return resp.status, await resp.read()


def post(script: Scripted, path: str, body: Any) -> tuple[int, bytes]:
    return asyncio.run(_post(script, path, body))


def chunks(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n")
            if line.startswith(b"data: {")]


def final_rows(events: list[dict[str, Any]]) -> dict[int, tuple[int, np.ndarray]]:
    out = {}
    for event in events:
        for choice in event.get("choices", []):
            if choice.get("finish_reason") is None:
                assert choice.get("routed_experts") is None
                continue
            out[choice["index"]] = (choice["routed_experts_start"],
                                    decode_npy(choice["routed_experts"], "test"))
    return out


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("start", [0, 3, PROMPT])
def test_non_streamed_rows_are_merged_on_every_endpoint(path: str, start: int) -> None:
    script = Scripted(prefill_answer(start), decode_answer(start))
    status, raw = post(script, path, client_body(path, start, stream=False))
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["routed_experts_start"] == start
    np.testing.assert_array_equal(decode_npy(choice["routed_experts"], "t"), rows(start, 9))
    # Prefill got one token of one choice, in the endpoint's own field layout.
    sent = script.sent["prefill"][0]
    sampling = sent["sampling_params"] if path == GENERATE else sent
    assert (sampling["max_tokens"], sampling["n"], sent["stream"]) == (1, 1, False)
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert script.sent["decode"][0]["kv_transfer_params"] == KV_PARAMS
    # Token ids: the generate endpoint always has them; the OpenAI ones only on request.
    assert (choice["token_ids"] == TOKENS) == (path == GENERATE)


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("start", [0, 3])
def test_each_streamed_choice_gets_its_merged_rows_on_its_final_chunk(
    path: str, start: int
) -> None:
    script = Scripted(prefill_answer(start), sse(stream_events(n=2)))
    status, raw = post(script, path, client_body(path, start, stream=True, n=2))
    assert status == 200, raw
    events = chunks(raw)
    assert len(events) == 2 * COMPLETION
    got = final_rows(events)
    assert sorted(got) == [0, 1]
    for index in (0, 1):
        assert got[index][0] == start
        np.testing.assert_array_equal(got[index][1], rows(start, 9))
    assert raw.endswith(b"data: [DONE]\n\n")
    # Decode was asked for token ids (to count C); the client did not ask for them.
    if path != GENERATE:
        assert script.sent["decode"][0]["return_token_ids"] is True
        assert all(c["token_ids"] is None for e in events for c in e["choices"])
        assert all(e.get("prompt_token_ids") is None for e in events)
    else:
        assert [t for e in events for c in e["choices"] if c["index"] == 0
                for t in c["token_ids"]] == TOKENS


def test_a_stream_without_rows_on_either_side_passes_through() -> None:
    """return_routed_experts false: neither side has rows; nothing to merge."""
    final = decode_choice(0)
    del final["routed_experts"], final["routed_experts_start"]
    prefill = prefill_answer(PROMPT)
    status, raw = post(Scripted(prefill, sse(stream_events(final=final))),
                       "/v1/completions", client_body("/v1/completions", 0, True))
    assert status == 200
    assert "error" not in raw.decode()
    assert all(c.get("routed_experts") is None for e in chunks(raw) for c in e["choices"])


@pytest.mark.parametrize(
    ("events", "says"),
    [
        # Negative control of the merge: decode's rows start one position late (a gap).
        (stream_events(final=decode_choice(0, rows(7, 9), start=7)),
         r"gap in routed_experts: prefill rows cover \[0, 6\), decode rows start at 7"),
        # One token short of what the rows cover: C is counted from the stream.
        (stream_events()[1:], r"expected \[routed_experts_prompt_start, P \+ C - 1\) = "
                              r"\[0, 8\) with P = 6, C = 3"),
        (stream_events(early_rows=True), "carries routed_experts before its final chunk"),
        (stream_events(final=decode_choice(0) | {"routed_experts": None}),
         "prefill response contained routed_experts, but decode choice 0 did not"),
    ],
    ids=["gap", "missing-token", "early-rows", "no-decode-rows"],
)
def test_a_stream_that_cannot_be_merged_ends_with_an_error_event(
    events: list[dict[str, Any]], says: str
) -> None:
    status, raw = post(Scripted(prefill_answer(0), sse(events)), "/v1/completions",
                       client_body("/v1/completions", 0, True))
    assert status == 200  # sent before the final chunk arrived
    out = chunks(raw)
    error = out[-1]["error"]
    assert error["code"] == 502 and error["type"] == "RoutedExpertsMergeError"
    assert re.search(says, error["message"]), error["message"]
    # The failing choice's final chunk never reached the client, with or without rows.
    assert not any(c.get("finish_reason") for e in out[:-1] for c in e.get("choices", []))
    assert raw.endswith(b"data: [DONE]\n\n")


def test_a_decode_error_before_the_stream_is_the_decode_status() -> None:
    refused = web.json_response({"error": {"message": "bad kv_transfer_params"}},
                                status=400)
    status, raw = post(Scripted(prefill_answer(0), refused), "/v1/completions",
                       client_body("/v1/completions", 0, True))
    assert status == 400
    assert "bad kv_transfer_params" in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"token_ids": [4, 5]}, "sampling_params must be an object on /inference/v1/generate"),
        ({"token_ids": [4], "sampling_params": {"routed_experts_prompt_start": -2}},
         "routed_experts_prompt_start must be a non-negative integer, got -2"),
    ],
)
def test_a_generate_body_the_proxy_cannot_route_is_400(body: dict, says: str) -> None:
    script = Scripted(prefill_answer(0), decode_answer())
    status, raw = post(script, GENERATE, body)
    assert status == 400
    assert says in json.loads(raw)["error"]["message"]
    assert script.sent == {"prefill": [], "decode": []}  # no backend saw it


def test_sse_lines_splits_across_chunks_without_a_length_limit() -> None:
    big = b"data: " + b"x" * (1 << 20) + b"\n"

    async def pieces() -> Any:
        for piece in (b"data: a\n\nda", b"ta: b\n", big[:7], big[7:], b"tail"):
            yield piece

    async def collect() -> list[bytes]:
        return [line async for line in sse_lines(pieces())]

    assert asyncio.run(collect()) == [b"data: a\n", b"\n", b"data: b\n", big, b"tail"]
