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
Streaming requests: decode's stream is forwarded with each choice's final
chunk merged the same way (`vllm_r3_pdproxy.stream`).
The same flow serves /v1/chat/completions and vLLM's token-in/token-out
/inference/v1/generate (`vllm_r3_pdproxy.endpoints`).

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

from vllm_r3_pdproxy.endpoints import (
    COMPLETIONS_PATH,
    PATHS,
    client_prompt_start,
    decode_body,
    prefill_body,
    prompt_length,
    wants_token_ids,
)
from vllm_r3_pdproxy.merge import MergeError, MergeReport, merge_choice
from vllm_r3_pdproxy.stream import StreamMerger, error_event, sse_lines

log = logging.getLogger("pdproxy")

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


def response_choices(response: dict[str, Any], side: str) -> list[dict[str, Any]]:
    choices = response.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise MergeError(f"{side} response choices must be an array of objects, got "
                         f"{type(choices).__name__}")
    return choices


def only_prefill_choice(prefill: dict[str, Any]) -> dict[str, Any]:
    """Prefill's one choice (the proxy sends it n=1)."""
    choices = response_choices(prefill, "prefill")
    if len(choices) != 1:
        raise MergeError(f"prefill response has {len(choices)} choices, expected 1")
    return choices[0]


def merge_response(body: dict[str, Any], prefill: dict[str, Any], decode: dict[str, Any],
                   overlap: str = "error", report: MergeReport | None = None,
                   path: str = COMPLETIONS_PATH) -> dict[str, Any]:
    """Merge routed experts into the decode response; strip what the client did not ask for."""
    prompt_start = client_prompt_start(body, path)
    prefill_choice = only_prefill_choice(prefill)
    decode_choices = response_choices(decode, "decode")
    for choice in decode_choices:
        token_ids = choice.get("token_ids")
        if not isinstance(token_ids, list):
            raise MergeError(f"decode choice {choice.get('index')} has no token_ids array "
                             f"(got {type(token_ids).__name__}); is it a vLLM server?")
        merge_choice(prefill_choice, choice, prompt_start,
                     prompt_length(decode, "decode", choice), len(token_ids), overlap, report)
        if not wants_token_ids(body, path):
            choice["token_ids"] = None
        if not body.get("return_token_ids") and "prompt_token_ids" in choice:
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
            prompt_start = client_prompt_start(body, path)
        except ValueError as exc:
            return _error(400, str(exc), "BadRequest")
        prefill_url, decode_url = self.backends.next_pair()
        start = time.monotonic()
        try:
            prefill = await self._post("prefill", prefill_url, path, prefill_body(body, path))
            kv_params = prefill.get("kv_transfer_params")
            if not isinstance(kv_params, dict):
                raise MergeError(f"prefill server {prefill_url} returned no kv_transfer_params; "
                                 "is it started with a NixlConnector (kv_producer or kv_both)?")
            if body.get("stream"):
                merger = StreamMerger(body, path, only_prefill_choice(prefill), prompt_start,
                                      prompt_length(prefill, "prefill"), self.overlap)
                return await self._stream(request, decode_url, path,
                                          decode_body(body, kv_params, path), merger)
            decode = await self._post("decode", decode_url, path,
                                      decode_body(body, kv_params, path))
            report = MergeReport()
            merged = merge_response(body, prefill, decode, self.overlap, report, path)
            self._count_overlap(report)
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

    def _count_overlap(self, report: MergeReport) -> None:
        if report.overlap_rows_differing:
            self.overlap_rows_differing += report.overlap_rows_differing
            log.warning("prefill and decode routed experts differ at position %d "
                        "(%d overlap rows); kept the %s row (--overlap %s)",
                        report.first_differing_position, report.overlap_rows_differing,
                        self.overlap, self.overlap)

    async def _stream(self, request: web.Request, url: str, path: str,
                      body: dict[str, Any], merger: StreamMerger) -> web.StreamResponse:
        """Decode's stream with each choice's final chunk merged (vllm_r3_pdproxy.stream).
        A decode error before the stream starts is an error response; a failure after
        it started ends the stream with an error event."""
        assert self.session is not None
        async with self.session.post(f"{url}{path}", json=body) as resp:
            if resp.status != 200:
                raise BackendError("decode", url, resp.status, await resp.text())
            out = web.StreamResponse(status=200, headers={"Content-Type": resp.headers.get(
                "Content-Type", "text/event-stream")})
            await out.prepare(request)
            try:
                async for line in sse_lines(resp.content.iter_any()):
                    if line.startswith(b"data: "):
                        data = merger.payload(line[len(b"data: "):].decode().rstrip("\r\n"))
                        line = f"data: {data}\n".encode()
                    await out.write(line)
            except MergeError as exc:
                self.errors += 1
                log.error("routed-experts merge failed in a stream (decode %s): %s", url, exc)
                await out.write(error_event(str(exc)))
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.errors += 1
                log.warning("decode stream from %s broke off: %s", url, exc)
                await out.write(error_event(f"decode server {url} stream broke off: {exc!r}",
                                            "BackendError"))
            else:
                self.merged += 1
                self._count_overlap(merger.report)
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
    for path in PATHS:
        app.router.add_post(path, proxy.handle)
    app.router.add_get("/health", proxy.health)
    app[PROXY] = proxy
    return app
