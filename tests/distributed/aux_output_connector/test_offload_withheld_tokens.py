"""What vllm:kv_offload_routed_experts_withheld_tokens counts (patch
`count-routed-experts-rows-and-control-plane-state`): the offloaded tokens a load
would have taken past where the routed-experts load limit stopped it.

A load takes consecutive ready chunks, so the withheld tokens are those of the
ready chunks from the one holding the hit's end up to the first chunk missing,
cut where a load without the limit would end (the last prompt token is always
computed). Expected values are derived by hand.
"""

from __future__ import annotations

import pytest

from vllm import SamplingParams
from vllm.distributed.aux_output_connector.offload import (
    withheld_load_end,
    withheld_tokens,
)
from vllm.v1.request import Request


@pytest.mark.parametrize(
    ("ready", "num_chunks", "per_chunk", "hit_end", "load_end", "expected"),
    [
        ({0, 1, 2, 3, 4}, 5, 16, 32, 83, 48),  # chunks 2-4
        ({0, 1, 3, 4}, 5, 16, 32, 83, 0),  # chunk 2 missing: no load reaches 3
        ({0, 1, 2, 4}, 5, 16, 32, 83, 16),  # chunk 2 only
        ({0, 1}, 2, 32, 48, 83, 16),  # the hit ends inside chunk 1: its rest
        ({0, 1, 2, 3, 4}, 5, 16, 16, 40, 24),  # an unlimited load ends at 40
        ({0, 1, 2, 3, 4}, 5, 16, 80, 83, 0),  # no chunk past the hit
        ({0, 1, 2, 3, 4}, 5, 16, 32, 32, 0),  # the limit did not bind
    ],
)
def test_withheld_tokens_table(
    ready: set[int],
    num_chunks: int,
    per_chunk: int,
    hit_end: int,
    load_end: int,
    expected: int,
) -> None:
    assert (
        withheld_tokens(ready.__contains__, num_chunks, per_chunk, hit_end, load_end)
        == expected
    )


def _request(skip_reading_prefix_cache: bool = False) -> Request:
    """A real request of 100 prompt tokens that reads the prefix cache or not."""
    params = SamplingParams(
        max_tokens=1, skip_reading_prefix_cache=skip_reading_prefix_cache
    )
    return Request(
        request_id="r",
        prompt_token_ids=list(range(100)),
        sampling_params=params,
        pooling_params=None,
    )


@pytest.mark.parametrize(
    ("aux_limit", "other_limit", "skip", "expected"),
    [
        (12, None, False, 99),  # 100 tokens: the last one is computed
        (12, 30, False, 50),  # another bound: 20 computed + 30
        (None, None, False, 20),  # no routed-experts limit (off, or P/D decode)
        (12, None, True, 20),  # the request reads no prefix cache at all
    ],
)
def test_withheld_load_end(
    aux_limit: int | None, other_limit: int | None, skip: bool, expected: int
) -> None:
    assert withheld_load_end(_request(skip), 20, aux_limit, other_limit) == expected
