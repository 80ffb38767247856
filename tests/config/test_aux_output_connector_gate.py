"""The routed-experts startup gate for P/D transports (patch
`allow-routed-experts-capture-with-nixlconnector-p-d`); the offload rows are in
test_aux_output_offload_gate.py (patch
`bound-offload-loads-to-positions-without-routed`).

`VllmConfig._verify_aux_output_compatibility` is called unbound on a namespace
that carries only what it reads, plus a real `KVTransferConfig` (aux_gate_utils.py).
Model Runner V1, which vLLM 0.34.0 removed, is refused on 0.31.0
(test_aux_output_model_runner_gate.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.config.aux_gate_utils import _child, _config, _kv, _multi, _verify
from vllm.config import KVTransferConfig
from vllm.distributed.aux_output_connector.disaggregated import is_pd_decode_request

SUPPORTED_MSG = (
    "P/D auxiliary output is supported with NixlConnector, NixlPullConnector"
)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
@pytest.mark.parametrize("name", ["NixlConnector", "NixlPullConnector"])
def test_nixl_pull_is_accepted(name: str, role: str) -> None:
    _verify(_config(_kv(name, role)))


def test_nixl_inside_multiconnector_is_accepted() -> None:
    _verify(
        _config(
            _multi(
                _child("NixlConnector", num_threads=1),
                _child("OffloadingConnector", cpu_bytes_to_use=1 << 30),
            )
        )
    )


@pytest.mark.parametrize(
    "name", ["NixlPushConnector", "MoRIIOConnector", "MooncakeConnector"]
)
def test_other_pd_connectors_are_rejected_with_what_is_supported(name: str) -> None:
    for kv in (_kv(name), _multi(_child("NixlConnector"), _child(name))):
        with pytest.raises(ValueError) as err:
            _verify(_config(kv))
        assert f"incompatible with {name}; {SUPPORTED_MSG} (pull mode) only." in str(
            err.value
        )


def test_bidirectional_transfer_is_rejected_alone_and_as_a_child() -> None:
    for kv in (
        _kv("NixlConnector", bidirectional_kv_xfer=True),
        _multi(_child("NixlConnector", bidirectional_kv_xfer=True)),
    ):
        with pytest.raises(
            ValueError, match="bidirectional_kv_xfer=true: a prefill-side pull"
        ):
            _verify(_config(kv))
    _verify(_config(_kv("NixlConnector", bidirectional_kv_xfer=False)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {
                "model_config": SimpleNamespace(
                    runner_type="generate", is_moe=False, is_hybrid=False
                )
            },
            "only supports MoE",
        ),
        (
            {"cache_config": SimpleNamespace(enable_prefix_caching=False)},
            "requires prefix caching",
        ),
        (
            {
                "parallel_config": SimpleNamespace(
                    pipeline_parallel_size=2,
                    decode_context_parallel_size=1,
                    prefill_context_parallel_size=1,
                )
            },
            "PP > 1",
        ),
        (
            {
                "parallel_config": SimpleNamespace(
                    pipeline_parallel_size=1,
                    decode_context_parallel_size=2,
                    prefill_context_parallel_size=1,
                )
            },
            "DCP/PCP > 1",
        ),
        (
            {"speculative_config": SimpleNamespace(enable_adaptive_verification=True)},
            "adaptive speculative verification",
        ),
    ],
)
def test_every_other_check_still_runs_with_nixl(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _verify(_config(_kv("NixlConnector"), **overrides))


def test_gate_is_inactive_without_routed_experts() -> None:
    _verify(
        _config(
            _kv("NixlPushConnector"), aux_output_config=SimpleNamespace(enabled=False)
        )
    )


def test_the_chain_iterator_walks_nested_multiconnectors() -> None:
    nested = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        engine_id="e0",
        kv_connector_extra_config={
            "connectors": [
                _child("NixlConnector"),
                {
                    "kv_connector": "MultiConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "connectors": [_child("MoRIIOConnector", a=1)]
                    },
                },
            ]
        },
    )
    chain = list(nested.iter_connector_chain())
    assert [(c.kv_connector, c.kv_connector_extra_config) for c in chain] == [
        ("NixlConnector", {}),
        ("MoRIIOConnector", {"a": 1}),
    ]
    assert {c.engine_id for c in chain} == {
        "e0"
    }  # children inherit it, as MultiConnector's
    assert list(KVTransferConfig().iter_connector_chain()) == []
    assert (
        list(_kv("NixlConnector").iter_connector_chain())[0].kv_connector
        == "NixlConnector"
    )


@pytest.mark.parametrize(
    ("params", "decode"),
    [
        (None, False),
        ({}, False),
        # P/D prefill request as the proxy sends it.
        (
            {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
            },
            False,
        ),
        # P/D decode request before the pull ...
        (
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "p0",
            },
            True,
        ),
        # ... and after NIXL updated the params in place.
        (
            {
                "do_remote_prefill": False,
                "remote_engine_id": "p0",
                "_remote_blocks_processed": True,
            },
            True,
        ),
        # A bidirectional prefill-side pull is not a decode request.
        ({"do_remote_decode": True, "remote_engine_id": "d0"}, False),
    ],
)
def test_pd_decode_request_recognition(
    params: dict[str, Any] | None, decode: bool
) -> None:
    assert is_pd_decode_request(params) is decode
