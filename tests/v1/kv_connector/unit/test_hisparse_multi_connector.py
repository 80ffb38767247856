"""A MultiConnector with a HiSparse child on a P/D decode instance (patch
`add-vllm-kv-transfer-config-per-role-p-d-connector`): NIXL's pull still wins the
load whatever the child order, and HiSparse never loads (the gates that accept the
chain: tests/config/test_hisparse_chain_policy.py).

Built without CUDA: HiSparseConnector without __init__ (which sizes the host pool
from a full config) around its real scheduler side, MultiConnector without
__init__ (which would build every child from the config, and HiSparse's worker
needs CUDA).
The NIXL child is the real scheduler-side connector of a real Scheduler.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.v1.aux_scheduler_utils import make_request, make_scheduler
from tests.v1.core.kv_load_failure_utils import nixl_pull_params
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
    HiSparseConnector,
    HiSparseConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

pytestmark = pytest.mark.usefixtures("scheduler_env")

BS = 16
PROMPT = [(11 * i) % 400 + 4 for i in range(40)]


def _hisparse() -> HiSparseConnector:
    connector = object.__new__(HiSparseConnector)
    connector.connector_scheduler = HiSparseConnectorScheduler(
        async_speculative=False, draft_kv_lookahead=0
    )
    connector.connector_worker = None
    return connector


def _multi(model_dir: Path, hisparse_first: bool) -> MultiConnector:
    nixl = make_scheduler(
        model_dir,
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both"),
        block_size=BS,
    ).connector
    multi = object.__new__(MultiConnector)
    multi._connectors = [_hisparse(), nixl] if hisparse_first else [nixl, _hisparse()]
    multi._requests_to_connector = {}
    return multi


@pytest.mark.parametrize("hisparse_first", [False, True])
def test_nixl_pull_wins_and_hisparse_never_loads(
    model_dir: Path, hisparse_first: bool
) -> None:
    multi = _multi(model_dir, hisparse_first)
    nixl_index = 1 if hisparse_first else 0
    hisparse = multi._connectors[1 - nixl_index]
    decode = make_request(
        "d", PROMPT, block_size=BS, kv_transfer_params=nixl_pull_params("d")
    )
    local = make_request("l", PROMPT, block_size=BS)
    assert hisparse.get_num_new_matched_tokens(decode, 0) == (0, False)
    expected = multi._connectors[nixl_index].get_num_new_matched_tokens(decode, 0)
    assert expected[0] == len(PROMPT)  # NIXL pulls the whole prompt
    assert multi.get_num_new_matched_tokens(decode, 0) == expected
    assert multi._requests_to_connector == {"d": nixl_index}
    # A request without P/D params loads nothing from either child.
    assert multi.get_num_new_matched_tokens(local, 0) == (0, False)
    assert "l" not in multi._requests_to_connector
