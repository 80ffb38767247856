"""An OpenAI-compatible proxy for 1P1D / xPyD over NIXL that merges routed experts.

Flow per request (non-streaming):
1. Send the body to a prefill server (round robin) with `max_tokens=1`,
   `stream=false` and NIXL's `kv_transfer_params` asking for a remote decode.
2. Send the original body to a decode server (round robin) with the
   `kv_transfer_params` prefill returned.
3. Merge each decode choice's routed experts with the prefill rows by position
   (`vllm_r3_pdproxy.merge`), and return the decode response.

Both requests ask for token ids, so the merge can check that the rows end at
P + C - 1; they are removed again when the client did not ask for them.
Streaming requests are passed through from the decode server without rows.

Failure policy: a backend error is returned with the backend's status and
message; a backend answer that is not a usable JSON response (not JSON, not an
object, fields missing or of the wrong type) and a merge inconsistency are
HTTP 502 naming the field, never a response with silently wrong rows; a backend
that does not answer within --timeout is HTTP 504. A client body the proxy
cannot route is HTTP 400 naming the field. The proxy keeps serving after each.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from vllm_r3_pdproxy.merge import MergeError, MergeReport, merge_choice

log = logging.getLogger("pdproxy")

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class BackendError(Exception):
    """A backend failed; `status` is what the proxy answers with."""

    def __init__(self, role: str, url: str, status: int, body: str) -> None:
        super().__init__(f"{role} server {url} answered HTTP {status}: {body[:2000]}")
        self.status = status

    @classmethod
    def unusable(cls, role: str, url: str, what: str) -> BackendError:
        """An HTTP 200 whose body is not a response object: 502."""
        error = cls(role, url, 502, "")
        error.args = (f"{role} server {url} answered HTTP 200 with {what}",)
        return error


@dataclass
class Backends:
    prefill: list[str]
    decode: list[str]
    _prefill_cycle: Iterator[str] = field(init=False)
    _decode_cycle: Iterator[str] = field(init=False)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("at least one prefill and one decode URL are required")
        self._prefill_cycle = itertools.cycle(self.prefill)
        self._decode_cycle = itertools.cycle(self.decode)

    def next_pair(self) -> tuple[str, str]:
        return next(self._prefill_cycle), next(self._decode_cycle)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    out.update(max_tokens=1, stream=False, return_token_ids=True,
               kv_transfer_params=dict(PREFILL_KV_PARAMS))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out["n"] = 1
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    out["kv_transfer_params"] = kv_transfer_params
    if not body.get("stream"):
        out["return_token_ids"] = True
    return out


def num_prompt_tokens(response: dict[str, Any], choice: dict[str, Any]) -> int:
    ids = choice.get("prompt_token_ids") or response.get("prompt_token_ids")
    if isinstance(ids, list):
        return len(ids)
    usage = response.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise MergeError("decode response has neither prompt_token_ids nor an integer "
                         f"usage.prompt_tokens (got usage={usage!r}); the merge needs "
                         "the prompt length")
    return tokens


def client_prompt_start(body: dict[str, Any]) -> int:
    """The client's routed_experts_prompt_start, checked before any backend sees it."""
    start = body.get("routed_experts_prompt_start", 0)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"routed_experts_prompt_start must be a non-negative integer, got "
                         f"{start!r}; send the position of the first prompt token whose "
                         "routed experts you want (0 for all), or leave it out")
    return start


def response_choices(response: dict[str, Any], side: str) -> list[dict[str, Any]]:
    choices = response.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise MergeError(f"{side} response choices must be an array of objects, got "
                         f"{type(choices).__name__}")
    return choices


def merge_response(body: dict[str, Any], prefill: dict[str, Any], decode: dict[str, Any],
                   overlap: str = "error", report: MergeReport | None = None) -> dict[str, Any]:
    """Merge routed experts into the decode response; strip what the client did not ask for."""
    prompt_start = client_prompt_start(body)
    prefill_choices = response_choices(prefill, "prefill")
    decode_choices = response_choices(decode, "decode")
    if len(prefill_choices) != 1:
        raise MergeError(f"prefill response has {len(prefill_choices)} choices, expected 1")
    for choice in decode_choices:
        token_ids = choice.get("token_ids")
        if not isinstance(token_ids, list):
            raise MergeError(f"decode choice {choice.get('index')} has no token_ids array "
                             f"(got {type(token_ids).__name__}); is it a vLLM server?")
        merge_choice(prefill_choices[0], choice, prompt_start,
                     num_prompt_tokens(decode, choice), len(token_ids), overlap, report)
        if not body.get("return_token_ids"):
            choice["token_ids"] = None
            if "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None
    if not body.get("return_token_ids") and "prompt_token_ids" in decode:
        decode["prompt_token_ids"] = None
    return decode


BACKEND_KEEPALIVE_S = 2.0  # below the backends' keep-alive timeout
DEFAULT_TIMEOUT_S = 600.0  # per backend request, prefill or decode


class Proxy:
    def __init__(self, backends: Backends, overlap: str = "error",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.backends = backends
        self.overlap = overlap
        self.overlap_rows_differing = 0
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.merged = 0
        self.errors = 0

    async def start(self, app: web.Application) -> None:
        # vLLM's server closes idle keep-alive connections after 5 s
        # (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); aiohttp keeps them 15 s by default, so a
        # request sent 5-15 s after the previous one could reuse a connection the
        # server is closing and fail with "Server disconnected". Drop them sooner.
        connector = aiohttp.TCPConnector(keepalive_timeout=BACKEND_KEEPALIVE_S)
        self.session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def _post(self, role: str, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.post(f"{url}{path}", json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise BackendError(role, url, resp.status, text)
        try:
            answer = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BackendError.unusable(
                role, url, f"a body that is not JSON ({exc}): {text[:200]!r}") from None
        if not isinstance(answer, dict):
            raise BackendError.unusable(
                role, url, f"a JSON {type(answer).__name__}, not a response object")
        return answer

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            return _error(400, f"request body is not JSON: {exc}", "BadRequest")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "BadRequest")
        try:
            client_prompt_start(body)
        except ValueError as exc:
            return _error(400, str(exc), "BadRequest")
        prefill_url, decode_url = self.backends.next_pair()
        start = time.monotonic()
        try:
            prefill = await self._post("prefill", prefill_url, path, prefill_body(body))
            kv_params = prefill.get("kv_transfer_params")
            if not isinstance(kv_params, dict):
                raise MergeError(f"prefill server {prefill_url} returned no kv_transfer_params; "
                                 "is it started with a NixlConnector (kv_producer or kv_both)?")
            if body.get("stream"):
                return await self._stream(request, decode_url, path, decode_body(body, kv_params))
            decode = await self._post("decode", decode_url, path, decode_body(body, kv_params))
            report = MergeReport()
            merged = merge_response(body, prefill, decode, self.overlap, report)
            if report.overlap_rows_differing:
                self.overlap_rows_differing += report.overlap_rows_differing
                log.warning("prefill and decode routed experts differ at position %d "
                            "(%d overlap rows); kept the %s row (--overlap %s)",
                            report.first_differing_position, report.overlap_rows_differing,
                            self.overlap, self.overlap)
        except BackendError as exc:
            self.errors += 1
            log.warning("%s", exc)
            return _error(exc.status if exc.status >= 400 else 502, str(exc), "BackendError")
        except MergeError as exc:
            self.errors += 1
            log.error("routed-experts merge failed (prefill %s, decode %s): %s",
                      prefill_url, decode_url, exc)
            return _error(502, str(exc), "RoutedExpertsMergeError")
        except aiohttp.ClientError as exc:
            self.errors += 1
            return _error(502, f"backend unreachable: {exc}", "BackendError")
        except TimeoutError:
            self.errors += 1
            return _error(504, f"a backend (prefill {prefill_url}, decode {decode_url}) did "
                          f"not answer within {self.timeout.total:.0f} s; raise --timeout "
                          "for longer requests", "BackendTimeout")
        self.merged += 1
        log.info("%s via %s -> %s in %.2f s", path, prefill_url, decode_url,
                 time.monotonic() - start)
        return web.json_response(merged)

    async def _stream(self, request: web.Request, url: str, path: str,
                      body: dict[str, Any]) -> web.StreamResponse:
        assert self.session is not None
        async with self.session.post(f"{url}{path}", json=body) as resp:
            out = web.StreamResponse(status=resp.status,
                                     headers={"Content-Type": resp.headers.get(
                                         "Content-Type", "text/event-stream")})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(self, request: web.Request) -> web.Response:
        assert self.session is not None
        status: dict[str, bool] = {}
        for url in self.backends.prefill + self.backends.decode:
            try:
                async with self.session.get(f"{url}/health",
                                            timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    status[url] = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                status[url] = False
        healthy = all(status.values())
        return web.json_response({"healthy": healthy, "backends": status,
                                  "merged": self.merged, "errors": self.errors,
                                  "overlap_policy": self.overlap,
                                  "overlap_rows_differing": self.overlap_rows_differing},
                                 status=200 if healthy else 503)


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


PROXY = web.AppKey("proxy", Proxy)


def make_app(backends: Backends, overlap: str = "error",
             timeout_s: float = DEFAULT_TIMEOUT_S) -> web.Application:
    proxy = Proxy(backends, overlap, timeout_s)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.handle)
    app.router.add_post("/v1/chat/completions", proxy.handle)
    app.router.add_get("/health", proxy.health)
    app[PROXY] = proxy
    return app
