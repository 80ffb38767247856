"""vLLM 0.31.0's routed-experts startup gate for connectors that may load prefix
KV without rows (patch bound-offload-loads-to-positions-without-routed): such a
loader, alone or as a MultiConnector child, and an offload on a hybrid model are
rejected at startup with an error that names the connector and the supported
ones. vLLM 0.34.0 caps their hits instead; its series lists
test_aux_output_unbounded_loaders_capped.py in place of this file.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.config.aux_gate_utils import (
    NIXL,
    UNBOUNDED_LOADERS,
    OutOfTreeConnector,
    _child,
    _config,
    _kv,
    _multi,
    _verify,
    out_of_tree,
)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVTransferKind

OFFLOAD_SUPPORTED = (
    "supported KV connectors are NixlConnector, NixlPullConnector, "
    "OffloadingConnector, MooncakeStoreConnector, HiSparseConnector"
)


class UndeclaredOffloadConnector(OutOfTreeConnector):
    kv_transfer_kind = KVTransferKind.KV_OFFLOAD


@pytest.mark.parametrize("name", UNBOUNDED_LOADERS)
def test_unbounded_loaders_are_rejected_alone_and_as_children(name: str) -> None:
    for kv in (_kv(name), _multi(_child("NixlConnector"), _child(name))):
        with pytest.raises(ValueError) as err:
            _verify(_config(kv))
        message = str(err.value)
        assert (
            f"incompatible with {name}: it loads KV blocks without their "
            "routed-experts rows" in message
        )
        assert OFFLOAD_SUPPORTED in message


@pytest.mark.parametrize("name", ["OffloadingConnector", "MooncakeStoreConnector"])
def test_offload_on_hybrid_models_is_rejected(name: str) -> None:
    hybrid = SimpleNamespace(runner_type="generate", is_moe=True, is_hybrid=True)
    with pytest.raises(ValueError, match=f"with {name} is not supported for hybrid"):
        _verify(
            _config(_multi(_child("NixlConnector"), _child(name)), model_config=hybrid)
        )
    _verify(
        _config(_kv("NixlConnector"), model_config=hybrid)
    )  # P/D alone stays accepted


def test_the_same_loader_without_the_declaration_is_rejected() -> None:
    for kv in (
        KVTransferConfig(**out_of_tree("UndeclaredOffloadConnector", __name__)),
        _multi(NIXL, out_of_tree("UndeclaredOffloadConnector", __name__)),
    ):
        with pytest.raises(
            ValueError,
            match="incompatible with UndeclaredOffloadConnector: it loads KV blocks "
            "without their routed-experts rows",
        ):
            _verify(_config(kv))
