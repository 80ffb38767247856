"""Merge routed experts into a streamed decode response, event by event.

Contract: the fork's servers put each choice's rows on the choice's final chunk
(the one with `finish_reason`), never earlier. Decode's stream is forwarded
event by event; each choice's final chunk gets the merge of prefill's rows
(from prefill's non-streaming response) and decode's rows
(`merge.merge_choice`), checked to end at P + C - 1, where P is prefill's
prompt length and C the number of token ids decode streamed for that choice.
Token ids the client did not ask for are removed again. Events that are not
JSON chunks (`[DONE]`, comments, vLLM's `{"error": ...}` events) pass unchanged.

Failure policy: the HTTP status is already sent when a chunk fails to merge, so
the merger raises `MergeError`; the proxy then ends the stream with one
`{"error": ...}` event naming the problem and `[DONE]`, as vLLM ends a stream
that fails. A choice never reaches the client with unmerged or unchecked rows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from vllm_r3_pdproxy.endpoints import wants_token_ids
from vllm_r3_pdproxy.merge import MergeError, MergeReport, merge_choice


@dataclass
class StreamMerger:
    """Rewrites the `data:` payloads of one decode stream."""

    body: dict[str, Any]
    path: str
    prefill_choice: dict[str, Any]
    prompt_start: int  # the client's routed_experts_prompt_start, already checked
    num_prompt: int
    overlap: str = "error"
    report: MergeReport = field(default_factory=MergeReport)
    completion_tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def payload(self, data: str) -> str:
        """One event's data, with the merged rows on a final chunk."""
        if not data.startswith("{"):
            return data  # [DONE]
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as exc:
            raise MergeError(f"decode stream event is not JSON ({exc}): {data[:200]!r}") \
                from None
        if not isinstance(chunk, dict) or "error" in chunk:
            return data
        choices = chunk.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise MergeError("decode stream chunk choices must be an array of objects, got "
                             f"{type(choices).__name__}")
        for choice in choices:
            self._choice(choice)
        if not self.body.get("return_token_ids") and "prompt_token_ids" in chunk:
            chunk["prompt_token_ids"] = None
        return json.dumps(chunk, separators=(",", ":"))

    def _choice(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int):
            raise MergeError(f"decode stream choice index must be an integer, got {index!r}")
        token_ids = choice.get("token_ids")
        if token_ids is not None and not isinstance(token_ids, list):
            raise MergeError(f"decode stream choice {index} token_ids must be an array, got "
                             f"{type(token_ids).__name__}")
        count = self.completion_tokens.get(index, 0) + len(token_ids or ())
        self.completion_tokens[index] = count
        if choice.get("finish_reason") is None:
            if choice.get("routed_experts") is not None:
                raise MergeError(f"decode stream choice {index} carries routed_experts before "
                                 "its final chunk; the proxy merges final-chunk rows only "
                                 "(is decode running the R3 fork?)")
        else:
            if index in self.finished:
                raise MergeError(f"decode stream choice {index} has two final chunks")
            self.finished.add(index)
            merge_choice(self.prefill_choice, choice, self.prompt_start, self.num_prompt,
                         count, self.overlap, self.report)
        if not wants_token_ids(self.body, self.path):
            choice["token_ids"] = None


def error_event(message: str, kind: str = "RoutedExpertsMergeError",
                code: int = 502) -> bytes:
    """The event that ends a stream that failed after its status was sent."""
    error = {"error": {"message": message, "type": kind, "code": code}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


async def sse_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The lines of a byte stream, each with its newline (the last may lack one).
    No length limit: a final chunk's rows can be megabytes on one line."""
    pending = bytearray()
    async for chunk in chunks:
        pending += chunk
        end = pending.find(b"\n")
        start = 0
        while end != -1:
            yield bytes(pending[start:end + 1])
            start = end + 1
            end = pending.find(b"\n", start)
        del pending[:start]
    if pending:
        yield bytes(pending)
