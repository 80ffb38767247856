"""Stand-ins for what `aux_output_load_limit` reads: a request's routed-experts
prompt start, KV-transfer params, retained-rows bound and lengths, and the config's
auxiliary-output switch."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def limit_request(
    prompt_start: int,
    params: dict[str, Any] | None = None,
    *,
    max_hit: int | None = None,
    num_tokens: int = 300,
    num_output_tokens: int = 0,
) -> SimpleNamespace:
    return SimpleNamespace(
        sampling_params=SimpleNamespace(routed_experts_prompt_start=prompt_start),
        kv_transfer_params=params,
        aux_output_max_hit=max_hit,
        num_tokens=num_tokens,
        num_output_tokens=num_output_tokens,
    )


def limit_config(enabled: bool = True) -> SimpleNamespace:
    return SimpleNamespace(aux_output_config=SimpleNamespace(enabled=enabled))
