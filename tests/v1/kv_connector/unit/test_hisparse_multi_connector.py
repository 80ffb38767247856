"""A MultiConnector with a HiSparse child on a P/D decode instance (patch 0010):
NIXL's pull still wins the load whatever the child order, and HiSparse never loads
(the gates that accept the chain: tests/config/test_hisparse_chain_policy.py).

Built the way vLLM's own HiSparse tests build it without CUDA: HiSparseConnector's
scheduler side through its real __init__ on a config namespace (it reads only the
host pool size and the speculative settings), MultiConnector without __init__
(which would build every child from the config, and HiSparse's worker needs CUDA).
The NIXL child is the real scheduler-side connector of a real Scheduler.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from aux_scheduler_utils import make_request, make_scheduler
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
    HiSparseConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

pytestmark = pytest.mark.usefixtures("scheduler_env")

BS = 16
PROMPT = [(11 * i) % 400 + 4 for i in range(40)]
CHAIN = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"connectors": [
             {"kv_connector": "NixlConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"num_threads": 1}},
             {"kv_connector": "HiSparseConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"host_pool_gib": 8}}]}}


def _hisparse() -> HiSparseConnector:
    config = SimpleNamespace(kv_transfer_config=KVTransferConfig(**CHAIN),
                             speculative_config=None, num_lookahead_tokens=0,
                             scheduler_config=SimpleNamespace(async_scheduling=False))
    return HiSparseConnector(config, KVConnectorRole.SCHEDULER,  # type: ignore[arg-type]
                             SimpleNamespace(hisparse_host_num_blocks=64))  # type: ignore[arg-type]


def _multi(model_dir: Path, hisparse_first: bool) -> MultiConnector:
    nixl = make_scheduler(model_dir, KVTransferConfig(kv_connector="NixlConnector",
                                                      kv_role="kv_both"),
                          block_size=BS).connector
    multi = object.__new__(MultiConnector)
    multi._connectors = [_hisparse(), nixl] if hisparse_first else [nixl, _hisparse()]
    multi._requests_to_connector = {}
    return multi


def _decode_params(rid: str) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": "prefill-0", "remote_request_id": f"prefill-{rid}",
            "remote_block_ids": [0, 1, 2], "remote_host": "127.0.0.1",
            "remote_port": 1234, "tp_size": 1}


@pytest.mark.parametrize("hisparse_first", [False, True])
def test_nixl_pull_wins_and_hisparse_never_loads(model_dir: Path,
                                                 hisparse_first: bool) -> None:
    multi = _multi(model_dir, hisparse_first)
    nixl_index = 1 if hisparse_first else 0
    hisparse = multi._connectors[1 - nixl_index]
    decode = make_request("d", PROMPT, block_size=BS, kv_transfer_params=_decode_params("d"))
    local = make_request("l", PROMPT, block_size=BS)
    assert hisparse.get_num_new_matched_tokens(decode, 0) == (0, False)
    expected = multi._connectors[nixl_index].get_num_new_matched_tokens(decode, 0)
    assert expected[0] == len(PROMPT)  # NIXL pulls the whole prompt
    assert multi.get_num_new_matched_tokens(decode, 0) == expected
    assert multi._requests_to_connector == {"d": nixl_index}
    # A request without P/D params loads nothing from either child.
    assert multi.get_num_new_matched_tokens(local, 0) == (0, False)
    assert "l" not in multi._requests_to_connector
