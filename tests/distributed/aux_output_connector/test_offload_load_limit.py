"""The load limit KV-offload connectors apply when routed experts are on (patch
`bound-offload-loads-to-positions-without-routed`).

limit = max(0, floor(s / bs) * bs - num_computed_tokens); None (unbounded) for P/D
decode requests and when auxiliary output is off. bs = 64 in the table, as in the
behaviour spec. On vLLM 0.34.0 the limit also reaches the scheduler's retained-rows
bound (Request.aux_output_max_hit) when that is further; the table's requests have
none (test_offload_load_limit_retained_rows.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.aux_output_connector.load_limit_utils import (
    limit_config,
    limit_request,
)
from vllm.distributed.aux_output_connector.offload import (
    aux_output_load_limit,
    min_load_limit,
)

BS = 64
PD_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
}
PD_DECODE_BEFORE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "p0",
}
PD_DECODE_AFTER = {"do_remote_prefill": False, "remote_engine_id": "p0"}


@pytest.mark.parametrize(
    ("prompt_start", "num_computed", "params", "limit"),
    [
        (0, 0, None, 0),  # first turn: no external load
        (100, 0, None, 64),  # up to the block before s
        (100, 64, None, 0),  # the local hit covers it
        (200, 64, None, 128),
        (128, 0, None, 128),  # s on a block boundary: the whole blocks before it
        (127, 0, None, 64),
        (100, 128, None, 0),  # computed beyond the floor: never negative
        (200, 0, PD_PREFILL, 192),  # P/D prefill is limited like any request
        (0, 64, PD_DECODE_BEFORE, None),  # P/D decode, before the pull ...
        (0, 64, PD_DECODE_AFTER, None),  # ... and after it
    ],
)
def test_limit_table(
    prompt_start: int,
    num_computed: int,
    params: dict[str, Any] | None,
    limit: int | None,
) -> None:
    assert (
        aux_output_load_limit(
            limit_config(), limit_request(prompt_start, params), num_computed, BS
        )
        == limit
    )


def test_no_limit_without_auxiliary_output() -> None:
    assert (
        aux_output_load_limit(limit_config(enabled=False), limit_request(0), 0, BS)
        is None
    )


def test_prompt_start_equal_to_an_aligned_prompt_length_admits_the_whole_prompt() -> (
    None
):
    # s = P = 128: the clamp allows 128 tokens; the scheduler's rewind to P - 1 then
    # starts the first capture mid-block, which the worker's partial-block skip covers.
    assert aux_output_load_limit(limit_config(), limit_request(128), 0, BS) == 128


@pytest.mark.parametrize(
    ("limits", "tightest"),
    [
        ((None, None), None),
        ((None, 64), 64),
        ((128, None), 128),
        ((128, 64), 64),
        ((0, None), 0),
    ],
)
def test_min_load_limit_treats_none_as_unbounded(
    limits: tuple[int | None, ...], tightest: int | None
) -> None:
    assert min_load_limit(*limits) == tightest
