"""n > 1 with P/D kv_transfer_params, as the API server admits it.

Prefill computes the prompt once and returns one hand-off whatever n asks (n
becomes 1 on the request it runs). Decode admits n > 1 when a connector of its
chain lets the n children share one load of the hand-off (NixlConnector), on one
engine; otherwise it refuses with a 400 naming n.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm import SamplingParams
from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.input_processor import InputProcessor, kv_connector_classes

HANDOFF: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[4, 5, 6]],
    "remote_engine_id": "b3a1-prefill",
    "remote_request_id": "cmpl-1-0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
}
NIXL = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")


def processor(
    kv_transfer_config: KVTransferConfig, data_parallel_size: int = 1
) -> InputProcessor:
    config = VllmConfig(
        kv_transfer_config=kv_transfer_config,
        parallel_config=ParallelConfig(data_parallel_size=data_parallel_size),
    )
    proc = object.__new__(InputProcessor)
    proc.vllm_config = config
    proc._kv_connector_classes = kv_connector_classes(config)
    return proc


def params(n: int, kv_transfer_params: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        n=n, seed=7, extra_args={"kv_transfer_params": dict(kv_transfer_params)}
    )


def test_prefill_computes_the_prompt_once_for_any_n() -> None:
    request = params(4, {"do_remote_decode": True})
    processor(NIXL)._check_kv_transfer_params(request)
    assert request.n == 1
    assert request.seed == 7


@pytest.mark.parametrize(
    "kv_transfer_config",
    [
        NIXL,
        KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "connectors": [
                    {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
                ]
            },
        ),
    ],
    ids=["nixl", "nixl-then-offload"],
)
def test_decode_admits_n_where_the_children_share_one_load(
    kv_transfer_config: KVTransferConfig,
) -> None:
    request = params(4, HANDOFF)
    processor(kv_transfer_config)._check_kv_transfer_params(request)
    assert request.n == 4


@pytest.mark.parametrize(
    ("kv_transfer_config", "data_parallel_size", "reason"),
    [
        (
            KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both"),
            1,
            "no configured KV connector lets requests share one hand-off",
        ),
        (NIXL, 2, "with data parallelism"),
    ],
    ids=["no-sharing-connector", "data-parallel"],
)
def test_decode_refuses_n_where_each_child_would_read_the_hand_off(
    kv_transfer_config: KVTransferConfig, data_parallel_size: int, reason: str
) -> None:
    proc = processor(kv_transfer_config, data_parallel_size)
    with pytest.raises(VLLMValidationError, match=reason) as error:
        proc._check_kv_transfer_params(params(3, HANDOFF))
    assert error.value.parameter == "n" and error.value.value == 3
    assert "Send n requests with n=1" in str(error.value)
    # Negative control: one sequence is always admitted.
    proc._check_kv_transfer_params(params(1, HANDOFF))
