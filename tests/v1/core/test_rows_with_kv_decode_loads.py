"""Loads a P/D decode request may take once its prompt rows travel with the KV.

With ``enable_routed_experts_transfer`` decode returns a P/D request's rows from
``routed_experts_prompt_start`` (s): the prompt's rows arrive with the NIXL pull.
After a failed pull (recomputed) or a preemption, decode looks the prefix up again,
and another connector of its chain (an offload tier, the Mooncake store) may load
it; those blocks have no rows. Such a load must stop at the block holding s, as
for any request. Before this, the P/D decode exemption let it through, and decode
returned rows read from stale rows-mirror slots (the soak found it: a Mooncake
master restart, failed loads, rows that differed from colocated serving).

Without the switch decode returns rows only from its own first forward, so the
exemption stays. Values are hand-derived: 16-token blocks, so the limit is
floor(s / 16) * 16 - num_computed_tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.v1.aux_scheduler_utils import make_request, make_scheduler
from vllm.config import KVTransferConfig
from vllm.distributed.aux_output_connector.disaggregated import ROWS_WITH_KV
from vllm.distributed.aux_output_connector.offload import aux_output_load_limit
from vllm.v1.core.sched.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("scheduler_env")

PROMPT = [(7 * i) % 300 + 3 for i in range(70)]  # 4 blocks of 16 and 6 tokens


def decode(model_dir: Path, rows_transfer: bool) -> Scheduler:
    return make_scheduler(
        model_dir,
        KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_consumer",
            kv_load_failure_policy="recompute",
        ),
        rows_transfer=rows_transfer,
    )


def pd_decode_params() -> dict:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_block_ids": [[1, 2, 3, 4, 5]],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
    }


@pytest.mark.parametrize("rows_transfer", [True, False])
def test_the_pull_marks_whether_the_rows_come_with_the_kv(
    model_dir: Path, rows_transfer: bool
) -> None:
    scheduler = decode(model_dir, rows_transfer)
    request = make_request(
        "r", PROMPT, prompt_start=40, kv_transfer_params=pd_decode_params()
    )
    assert scheduler.connector is not None
    hit, load_async = scheduler.connector.get_num_new_matched_tokens(request, 0)
    assert load_async and 0 < hit <= len(PROMPT)  # the pull
    assert request.kv_transfer_params[ROWS_WITH_KV] is rows_transfer
    # After the pull (NIXL clears do_remote_prefill), a reload through another
    # connector is bounded only when the rows came with the KV.
    request.kv_transfer_params["do_remote_prefill"] = False
    limit = aux_output_load_limit(scheduler.vllm_config, request, 0, 16)
    assert limit == (32 if rows_transfer else None)
    assert aux_output_load_limit(scheduler.vllm_config, request, 16, 16) == (
        16 if rows_transfer else None
    )


@pytest.mark.parametrize(
    ("prompt_start", "num_computed", "limit"),
    [(0, 0, 0), (40, 0, 32), (40, 48, 0), (64, 16, 48), (70, 0, 64)],
)
def test_a_marked_request_is_bounded_like_any_request(
    model_dir: Path, prompt_start: int, num_computed: int, limit: int
) -> None:
    scheduler = decode(model_dir, rows_transfer=True)
    params = pd_decode_params() | {"do_remote_prefill": False, ROWS_WITH_KV: True}
    request = make_request(
        "r", PROMPT, prompt_start=prompt_start, kv_transfer_params=params
    )
    assert (
        aux_output_load_limit(scheduler.vllm_config, request, num_computed, 16) == limit
    )
    # The control: the same request unmarked keeps the P/D decode exemption.
    params[ROWS_WITH_KV] = False
    assert (
        aux_output_load_limit(scheduler.vllm_config, request, num_computed, 16) is None
    )
