"""kv_transfer_params a NIXL decode request must carry, checked at the API server.

Before this check, a decode request whose parameters missed a field or had one
of the wrong type waited for its KV forever (the scheduler logged "Got invalid
KVTransferParams" and never scheduled it; measured on a real Scheduler). Now
the API server refuses it with 400, naming the field. The good parameters are
those a NIXL producer returns (pull_scheduler.request_finished), written out
by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm import SamplingParams
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.transfer_params import (
    check_remote_prefill_params,
)
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.input_processor import InputProcessor, kv_connector_classes

GOOD: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[4, 5, 6]],
    "remote_engine_id": "b3a1-prefill",
    "remote_request_id": "cmpl-1-0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 70,
    "remote_blocks_expiry_time": None,
    "remote_block_generations": [[0, 2, 0]],
    "transfer_mode": "pull",
}


def test_a_producers_params_pass() -> None:
    check_remote_prefill_params(dict(GOOD))
    check_remote_prefill_params(  # one group, as a flat list
        {**GOOD, "remote_block_ids": [4, 5], "remote_block_generations": [[0, 1]]}
    )
    check_remote_prefill_params(
        {
            **GOOD,
            "remote_block_ids": [],
            "remote_num_tokens": 0,
            "remote_block_generations": None,
        }
    )
    check_remote_prefill_params({"do_remote_decode": True})  # a prefill request
    # Handed over in process, unserialised: tuples; and 0.33's registration generation.
    check_remote_prefill_params(
        {**GOOD, "remote_block_ids": ([4, 5, 6],), "remote_registration_generation": 3}
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("remote_host", None, "remote_host must be a non-empty string, got nothing"),
        ("remote_engine_id", "", "remote_engine_id must be a non-empty string, got ''"),
        ("remote_request_id", 7, "remote_request_id must be a non-empty string, got 7"),
        (
            "remote_port",
            "5600",
            r"remote_port must be a port number \(1-65535\), got '5600'",
        ),
        ("remote_port", 70000, "remote_port must be a port number"),
        ("remote_port", True, "remote_port must be a port number"),
        ("remote_block_ids", "4,5", "remote_block_ids must be a list of non-negative"),
        (
            "remote_block_ids",
            [[4, -1]],
            "remote_block_ids must be a list of non-negative",
        ),
        (
            "remote_block_ids",
            [[4], 5],
            "remote_block_ids must be a list of non-negative",
        ),
        ("tp_size", 0, "tp_size must be an integer >= 1, got 0"),
        (
            "remote_num_tokens",
            -3,
            "remote_num_tokens must be an integer >= 0 when given",
        ),
        (
            "remote_block_size",
            0,
            "remote_block_size must be an integer >= 1 when given",
        ),
        (
            "remote_registration_generation",
            "x",
            "remote_registration_generation must be",
        ),
        (
            "remote_blocks_expiry_time",
            "soon",
            "remote_blocks_expiry_time must be a number",
        ),
        (
            "remote_block_generations",
            [[0]],
            r"remote_block_generations must be one list",
        ),
        # Elements that are not non-negative integers: a 400, never a 500.
        (
            "remote_block_generations",
            [[0, {"gen": 2}, 0]],
            r"remote_block_generations must be one list of non-negative integers",
        ),
        (
            "remote_block_generations",
            [[0, True, 0]],
            r"remote_block_generations must be one list of non-negative integers",
        ),
    ],
)
def test_each_bad_field_is_named_with_the_fix(
    field: str, value: Any, message: str
) -> None:
    params = dict(GOOD)
    if value is None:
        params.pop(field)
    else:
        params[field] = value
    with pytest.raises(ValueError, match=message) as error:
        check_remote_prefill_params(params)
    assert "kv_transfer_params" in str(error.value)
    if field != "remote_block_generations":
        assert "returned, unchanged" in str(error.value)


def processor(kv_transfer_config: KVTransferConfig | None) -> InputProcessor:
    config = VllmConfig(kv_transfer_config=kv_transfer_config)
    proc = object.__new__(InputProcessor)
    proc.vllm_config = config
    proc._kv_connector_classes = kv_connector_classes(config)
    return proc


def nixl_child() -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


@pytest.mark.parametrize(
    "kv_transfer_config",
    [
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer"),
        KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "connectors": [
                    nixl_child(),
                    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
                ]
            },
        ),
    ],
    ids=["nixl", "multi-connector-with-nixl"],
)
def test_the_input_processor_refuses_them_as_a_400(
    kv_transfer_config: KVTransferConfig,
) -> None:
    proc = processor(kv_transfer_config)
    bad = SamplingParams(
        extra_args={"kv_transfer_params": {**GOOD, "remote_port": "x"}}
    )
    with pytest.raises(VLLMValidationError, match="remote_port must be") as error:
        proc._check_kv_transfer_params(bad)
    assert error.value.parameter == "kv_transfer_params"
    proc._check_kv_transfer_params(
        SamplingParams(extra_args={"kv_transfer_params": GOOD})
    )
    proc._check_kv_transfer_params(SamplingParams())


def test_without_a_connector_nothing_is_checked() -> None:
    """Negative control: the same bad parameters pass where no connector reads them."""
    bad = SamplingParams(
        extra_args={"kv_transfer_params": {**GOOD, "remote_port": "x"}}
    )
    processor(None)._check_kv_transfer_params(bad)


@pytest.mark.usefixtures("scheduler_env")
@pytest.mark.parametrize("complete", [True, False])
def test_a_refused_request_notifies_its_producer_only_when_it_can(
    model_dir: Path, complete: bool
) -> None:
    """The API server hands a refused decode request to the engine, aborted,
    so the producer frees its blocks. With unusable parameters that used to
    raise KeyError in build_connector_meta and kill the engine."""
    from tests.v1.aux_scheduler_utils import make_request, make_scheduler
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler(
        model_dir,
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer"),
        aux=False,
    )
    params = dict(GOOD) if complete else {**GOOD, "remote_host": None}
    scheduler.add_request(make_request("r", [0], kv_transfer_params=params))
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    meta = scheduler.schedule().kv_connector_metadata
    assert list(meta.reqs_to_recv) == (["r"] if complete else [])


def test_parallel_sampling_under_p_d_is_refused_naming_n() -> None:
    """Decode's n sequences would each pull the same hand-off, the second after
    prefill had freed its blocks, unless a connector lets them share one load:
    where none does (here an offload connector handed P/D parameters), n > 1
    with do_remote_prefill is refused."""
    proc = processor(
        KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
    )
    with pytest.raises(VLLMValidationError) as error:
        proc._check_kv_transfer_params(
            SamplingParams(n=2, extra_args={"kv_transfer_params": GOOD})
        )
    assert error.value.parameter == "n" and error.value.value == 2
    assert "n=1" in str(error.value)
    # Negative controls: n=1 with the same parameters, n=2 without P/D.
    proc._check_kv_transfer_params(
        SamplingParams(n=1, extra_args={"kv_transfer_params": GOOD})
    )
    proc._check_kv_transfer_params(SamplingParams(n=2))
