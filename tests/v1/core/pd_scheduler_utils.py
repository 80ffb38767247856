"""A P/D decode request, as a NixlConnector kv_consumer's Scheduler sees it, for the
scheduler tests (test_aux_output_pd_scheduler.py, tests/v1/metrics)."""

from __future__ import annotations

from tests.v1.aux_scheduler_utils import make_request
from vllm.v1.request import Request

PROMPT = 21  # first forward at 20: mid-block


def decode_request(rid: str, max_tokens: int = 3) -> Request:
    return make_request(
        rid,
        [(7 * i) % 500 + 4 for i in range(PROMPT)],
        max_tokens=max_tokens,
        kv_transfer_params={
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "prefill-0",
            "remote_request_id": f"prefill-{rid}",
            "remote_block_ids": [0, 1],
            "remote_host": "127.0.0.1",
            "remote_port": 1234,
            "tp_size": 1,
        },
    )
