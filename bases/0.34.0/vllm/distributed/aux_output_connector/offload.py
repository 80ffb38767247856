# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Policy for auxiliary outputs with KV connectors that load prefix KV.

Contract:
- Auxiliary rows (e.g. routed experts) live in a worker-local store keyed by
  KV block hash, and no KV connector moves them with the KV. A block filled by
  an external load (KV offload, a NIXL pull) has rows only if the scheduler
  still retains them for that block (``AuxOutputSchedulerConnector``).
- A request emits rows from ``rows_needed_from`` on: its
  ``routed_experts_prompt_start`` (s), or its last token after a preemption.
  The whole blocks before that position need no rows, so a prefix hit may
  always cover them (``rowless_prefix_end``). ``max_cache_hit`` is therefore
  the larger of that end and the end of the blocks whose rows this instance
  has; ``cap_external_hit`` accepts loads up to it.
- The scheduler leaves ``max_cache_hit`` on the request
  (``Request.aux_output_max_hit``) before it asks the KV connector for a hit.
  ``OffloadingConnector`` and ``MooncakeStoreConnector`` bound their hit by
  it (``aux_output_load_limit``), so a hit that runs past the rows still
  loads its bounded part instead of being refused whole. They declare
  ``routed_experts_support = RoutedExpertsSupport.BOUNDED_LOADS``.
- P/D decode requests are exempt: they emit from their first forward on the
  decode instance (the decode emit floor), never from loaded positions. Not
  when their prompt rows travel with the KV (``ROWS_WITH_KV``): they then
  emit from s, and another connector's load has no rows.
- No limit applies when auxiliary output is off.

Failure policy: a hit that would still reach a block without rows fails
closed on the worker (``BlockObjectStoreError``); connectors that do not
bound their hit are refused whole by ``cap_external_hit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm.distributed.aux_output_connector.disaggregated import (
    emits_from_first_forward,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


def rows_needed_from(request: Request) -> int:
    """The first position whose rows a request will still emit.

    ``routed_experts_prompt_start`` before any output; after a preemption the
    resumed request emits from its last token (``num_tokens - 1``) on.
    """
    sampling_params = request.sampling_params
    prompt_start = sampling_params.routed_experts_prompt_start if sampling_params else 0
    if request.num_output_tokens == 0:
        return prompt_start
    return max(prompt_start, request.num_tokens - 1)


def rowless_prefix_end(request: Request, block_size: int) -> int:
    """The end of the whole blocks before any position that needs rows."""
    return rows_needed_from(request) // block_size * block_size


def aux_output_load_limit(
    vllm_config: VllmConfig,
    request: Request,
    num_computed_tokens: int,
    block_size: int,
) -> int | None:
    """Tokens an external load may add past ``num_computed_tokens``.

    None means unbounded: auxiliary output is off, or the request is a P/D
    decode request that emits from its first forward here.
    """
    if not vllm_config.aux_output_config.enabled:
        return None
    if emits_from_first_forward(request.kv_transfer_params):
        return None
    end = rowless_prefix_end(request, block_size)
    if request.aux_output_max_hit is not None:
        end = max(end, request.aux_output_max_hit)
    return max(0, end - num_computed_tokens)


def min_load_limit(*limits: int | None) -> int | None:
    """The tightest of several load limits, where None means unbounded."""
    bounded = [limit for limit in limits if limit is not None]
    return min(bounded) if bounded else None


def withheld_load_end(
    request: Request,
    num_computed_tokens: int,
    aux_limit: int | None,
    other_limit: int | None,
) -> int:
    """Where a load could have ended without ``aux_limit`` (the routed-experts
    limit): ``num_computed_tokens`` when that limit does not apply."""
    if aux_limit is None or request.skip_reading_external_kv:
        return num_computed_tokens
    end = request.num_tokens - 1
    if other_limit is not None:
        end = min(end, num_computed_tokens + other_limit)
    return end


def withheld_tokens(
    chunk_is_ready: Callable[[int], bool],
    num_chunks: int,
    tokens_per_chunk: int,
    hit_end: int,
    load_end: int,
) -> int:
    """Offloaded tokens in ``[hit_end, load_end)`` that a load stopped before.

    A load takes consecutive chunks: count the ready ones from the chunk
    holding ``hit_end`` on, up to the first that is not ready.
    """
    end = hit_end
    for chunk in range(hit_end // tokens_per_chunk, num_chunks):
        if end >= load_end or not chunk_is_ready(chunk):
            break
        end = min(load_end, (chunk + 1) * tokens_per_chunk)
    return max(0, end - hit_end)
