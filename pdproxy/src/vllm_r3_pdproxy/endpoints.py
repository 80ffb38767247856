"""Where each endpoint the proxy serves keeps the fields it rewrites.

The OpenAI endpoints (`/v1/completions`, `/v1/chat/completions`) keep the
sampling fields (`max_tokens`, `n`, `routed_experts_prompt_start`) at the top
level of the body. vLLM's token-in/token-out generate endpoint
(`/inference/v1/generate`, served with `--enable-scale-out`) keeps them in
`sampling_params`; its choices always carry `token_ids`, and its
`return_token_ids` asks for the prompt's ids only. `stream`,
`kv_transfer_params` and `return_token_ids` are top-level fields everywhere.

Failure policy: a body whose sampling fields cannot be found or hold a value
the proxy cannot route raises `ValueError` naming the field and the fix; the
proxy answers HTTP 400 before any backend sees the request.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm_r3_pdproxy.merge import MergeError

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
GENERATE_PATH = "/inference/v1/generate"
PATHS = (COMPLETIONS_PATH, CHAT_PATH, GENERATE_PATH)

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def sampling_fields(body: dict[str, Any], path: str) -> dict[str, Any]:
    """The object holding the request's sampling fields (the body itself, or
    `sampling_params` for the generate endpoint)."""
    if path != GENERATE_PATH:
        return body
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise ValueError(f"sampling_params must be an object on {GENERATE_PATH}, got "
                         f"{type(params).__name__}; send e.g. "
                         '{"sampling_params": {"max_tokens": 16}}')
    return params


def client_prompt_start(body: dict[str, Any], path: str = COMPLETIONS_PATH) -> int:
    """The client's routed_experts_prompt_start, checked before any backend sees it."""
    start = sampling_fields(body, path).get("routed_experts_prompt_start", 0)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"routed_experts_prompt_start must be a non-negative integer, got "
                         f"{start!r}; send the position of the first prompt token whose "
                         "routed experts you want (0 for all), or leave it out")
    return start


def wants_token_ids(body: dict[str, Any], path: str) -> bool:
    """Whether the client's response carries completion token ids: the generate
    endpoint always sends them, the OpenAI endpoints with `return_token_ids`."""
    return path == GENERATE_PATH or bool(body.get("return_token_ids"))


def prefill_body(body: dict[str, Any], path: str = COMPLETIONS_PATH) -> dict[str, Any]:
    """One non-streaming choice of one token, asking for a remote decode."""
    out = copy.deepcopy(body)
    out.update(stream=False, return_token_ids=True,
               kv_transfer_params=dict(PREFILL_KV_PARAMS))
    out.pop("stream_options", None)
    params = sampling_fields(out, path)
    params.update(max_tokens=1, n=1)
    if "max_completion_tokens" in params:
        params["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any],
                path: str = COMPLETIONS_PATH) -> dict[str, Any]:
    """The client's request with prefill's transfer parameters; it asks for
    token ids (streamed too) so the merge can check that rows end at P + C - 1."""
    out = dict(body)
    out["kv_transfer_params"] = kv_transfer_params
    if path != GENERATE_PATH:
        out["return_token_ids"] = True
    return out


def prompt_length(response: dict[str, Any], side: str,
                  choice: dict[str, Any] | None = None) -> int:
    """P of a non-streaming response: its (or the choice's) prompt ids, else
    `usage.prompt_tokens`; `MergeError` naming the side when neither is there."""
    ids = (choice or {}).get("prompt_token_ids") or response.get("prompt_token_ids")
    if isinstance(ids, list):
        return len(ids)
    usage = response.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise MergeError(f"{side} response has neither prompt_token_ids nor an integer "
                         f"usage.prompt_tokens (got usage={usage!r}); the merge needs "
                         "the prompt length")
    return tokens
