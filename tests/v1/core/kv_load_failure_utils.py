"""A request whose KV a NixlConnector kv_consumer pulls from prefill, for the KV
load failure tests (test_kv_load_failure_reason.py, tests/v1/metrics) and the
HiSparse MultiConnector test."""

from __future__ import annotations

from typing import Any

from tests.v1.aux_scheduler_utils import make_request


def nixl_pull_params(rid: str) -> dict[str, Any]:
    """The kv_transfer_params a router sends decode for prefill's request `rid`."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_request_id": f"prefill-{rid}",
        "remote_block_ids": [0, 1, 2],
        "remote_host": "127.0.0.1",
        "remote_port": 1234,
        "tp_size": 1,
    }


def remote_request(rid: str):
    return make_request(
        rid,
        [(3 * i) % 200 + 5 for i in range(40)],
        kv_transfer_params=nixl_pull_params(rid),
    )
