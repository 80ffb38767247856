"""A decode instance refuses unusable kv_transfer_params with a 400 and keeps
serving (patch `refuse-malformed-kv-transfer-params-at-the-api`), served on CPU.

Before the check such a request was admitted and then waited for its KV forever
(the scheduler logged "Got invalid KVTransferParams" and never scheduled it).
The unit tests (tests/v1/kv_connector/unit/test_nixl_transfer_params.py) cover
every field; this runs the real API server once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.testbed.cpu_server import VllmServer, cpu_env, free_port, post_json
from tools.testbed.tiny_moe import build

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

DECODE_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}


def post(url: str, body: dict) -> tuple[int, dict]:
    return post_json(url, "/v1/completions", body, timeout=120)


def test_decode_refuses_bad_params_and_keeps_serving(tmp_path: Path) -> None:
    model = tmp_path / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    # Model Runner V2 through Triton's interpreter: vLLM 0.34.0 refuses x86 CPUs
    # without Triton, and 0.31.0 serves either way.
    env = cpu_env() | {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
    }
    server = VllmServer(
        model=model,
        log_path=tmp_path / "decode.log",
        extra_args=("--kv-transfer-config", json.dumps(DECODE_CONFIG)),
        env=env,
    )
    body = {"model": "tiny", "prompt": list(range(5, 45)), "max_tokens": 2}
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_request_id": "cmpl-1-0",
        "remote_port": 5600,
        "remote_block_ids": [[0, 1]],
    }  # no remote_host
    with server:
        status, answer = post(server.url, body | {"kv_transfer_params": params})
        assert status == 400, answer
        message = answer["error"]["message"]
        assert "kv_transfer_params.remote_host must be a non-empty string" in message
        assert "returned, unchanged" in message
        status, answer = post(server.url, body)
        assert status == 200 and len(answer["choices"][0]["text"]) > 0, answer
