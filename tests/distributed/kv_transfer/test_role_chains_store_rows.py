"""`vllm kv-transfer-config --routed-experts-transfer` with the Mooncake store (patch
`store-routed-experts-rows-beside-mooncake-store`): rows objects are stored beside
its chunks, so the switch goes on the MooncakeStoreConnector too, as a P/D role's
MultiConnector child and alone for a colocated role, and the chain passes the
startup check.
"""

from __future__ import annotations

import json

from tests.distributed.kv_transfer.rows_transfer_chains_utils import (
    run_cli,
    startup_check,
)
from vllm.distributed.kv_transfer.role_chains import (
    Deployment,
    Offload,
    build_role_config,
)


def test_the_mooncake_store_child_carries_rows_where_the_base_stores_them() -> None:
    """The Mooncake store child gets the switch: rows objects are stored beside its
    chunks."""
    config = build_role_config(
        Deployment(
            pd=True, offload=Offload("mooncake", 1 << 30), routed_experts_transfer=True
        ),
        "prefill",
    )
    children = config.kv_transfer_config["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == [
        "NixlConnector",
        "MooncakeStoreConnector",
    ]
    assert children[0]["enable_routed_experts_transfer"] is True
    assert children[1]["enable_routed_experts_transfer"] is True
    startup_check(config.kv_transfer_config)


def test_colocated_with_the_mooncake_store_sets_it_on_the_store() -> None:
    code, out, err = run_cli(
        [
            "--role",
            "colocated",
            "--offload",
            "mooncake:1GiB",
            "--routed-experts-transfer",
        ]
    )
    assert code == 0, err
    config = json.loads(out)
    assert config["kv_connector"] == "MooncakeStoreConnector"
    assert config["enable_routed_experts_transfer"] is True
    assert "routed-experts rows with the chunks" in err
    startup_check(config)
