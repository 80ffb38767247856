"""`vllm kv-transfer-config --routed-experts-transfer` with a native offload (patch
`carry-routed-experts-rows-with-offloaded-kv-chunks`): the offload's chunks carry
rows, so the switch goes on the OffloadingConnector too, in a P/D role's
MultiConnector and alone for a colocated role; a colocated role without an offload
that carries rows is refused with the one that does. Checked against JSON written
by hand from the rule in docs/r3-pd-rows-transfer.md and against the startup check.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.kv_transfer.rows_transfer_chains_utils import (
    NIXL_WITH_ROWS,
    OFFLOAD_1GIB,
    multi_with_switch,
    run_cli,
    startup_check,
)
from vllm.distributed.kv_transfer.role_chains import (
    Deployment,
    Offload,
    RoleConfigError,
    build_role_config,
)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_multiconnector_sets_it_on_itself_and_its_carriers(role: str) -> None:
    config = build_role_config(
        Deployment(
            pd=True, offload=Offload("native", 1 << 30), routed_experts_transfer=True
        ),
        role,  # type: ignore[arg-type]
    )
    offload = OFFLOAD_1GIB | {"enable_routed_experts_transfer": True}
    assert config.kv_transfer_config == multi_with_switch(NIXL_WITH_ROWS, offload)
    startup_check(config.kv_transfer_config)


def test_colocated_with_native_offload_sets_it_on_the_offload() -> None:
    code, out, err = run_cli(
        ["--role", "colocated", "--offload", "native:1GiB", "--routed-experts-transfer"]
    )
    assert code == 0, err
    assert json.loads(out) == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
        "enable_routed_experts_transfer": True,
    }
    assert "routed-experts rows with the chunks" in err
    assert "both roles" not in err  # the P/D reminder is not for a colocated role
    startup_check(json.loads(out))


@pytest.mark.parametrize(("offload", "named"), [([], "no KV offload")])
def test_colocated_without_an_offload_that_carries_rows_is_refused(
    offload: list[str], named: str
) -> None:
    code, out, err = run_cli(
        ["--role", "colocated", *offload, "--routed-experts-transfer"]
    )
    assert code == 2
    assert out == ""
    assert "--routed-experts-transfer with --role colocated" in err
    assert "Drop --routed-experts-transfer" in err
    assert f"--role colocated and {named}" in err
    assert "--offload native:SIZE" in err
    with pytest.raises(RoleConfigError, match="--routed-experts-transfer"):
        build_role_config(
            Deployment(pd=False, routed_experts_transfer=True), "colocated"
        )
