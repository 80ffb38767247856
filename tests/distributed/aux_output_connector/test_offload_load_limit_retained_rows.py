"""The load limit reaches vLLM 0.34.0's retained-rows bound (patch
`bound-offload-loads-to-positions-without-routed`, vLLM 0.34.0's shape).

vLLM 0.34.0 retains routed-experts rows for cached blocks and caps every external
hit at them (`Request.aux_output_max_hit`); the offload load limit is the further
of that bound and the rowless blocks before the prompt start. vLLM 0.31.0 has no
such bound: its series does not list this file. bs = 64.
"""

from __future__ import annotations

import pytest

from tests.distributed.aux_output_connector.load_limit_utils import (
    limit_config,
    limit_request,
)
from vllm.distributed.aux_output_connector.offload import aux_output_load_limit

BS = 64


@pytest.mark.parametrize(
    ("prompt_start", "max_hit", "num_computed", "limit"),
    [
        (0, 128, 0, 128),  # rows retained for 128 tokens: they may all load
        (0, 128, 64, 64),
        (0, 0, 0, 0),  # nothing retained, rows needed from 0: nothing loads
        (200, 128, 0, 192),  # the rowless blocks reach further than the rows
        (100, 256, 64, 192),  # the rows reach further than the rowless blocks
        (0, 128, 192, 0),  # never negative
    ],
)
def test_limit_reaches_the_retained_rows_bound(
    prompt_start: int, max_hit: int, num_computed: int, limit: int
) -> None:
    request = limit_request(prompt_start, max_hit=max_hit)
    assert aux_output_load_limit(limit_config(), request, num_computed, BS) == limit


def test_a_resumed_request_needs_rows_only_from_its_last_token() -> None:
    # Preempted after 40 outputs of a 260-token prompt: rows are needed from 299 on.
    resumed = limit_request(0, num_tokens=300, num_output_tokens=40)
    assert aux_output_load_limit(limit_config(), resumed, 0, BS) == 256
    assert (
        aux_output_load_limit(limit_config(), limit_request(0), 0, BS) == 0
    )  # control: not resumed
