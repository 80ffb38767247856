"""`vllm kv-transfer-config --routed-experts-transfer` (patch
`transfer-routed-experts-rows-with-the-kv-over-nixl`): the P/D roles' chains with
`enable_routed_experts_transfer`, checked against JSON written by hand from the rule
in docs/r3-pd-rows-transfer.md (the switch on the config and, in a MultiConnector, on
its NixlConnector child), and against the startup check `vllm serve` runs
on the switch (`verify_routed_experts_transfer`), with a planted fault that check must
catch. Offload children whose chunks carry rows: test_role_chains_offload_rows.py
and test_role_chains_store_rows.py (the PRs that make them carry rows).
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
def test_bare_nixl_sets_the_switch(role: str) -> None:
    code, out, err = run_cli(["--role", role, "--routed-experts-transfer"])
    assert code == 0, err
    assert json.loads(out) == NIXL_WITH_ROWS
    assert (
        f"{role}: NixlConnector (P/D KV transfer, routed-experts rows with the KV)"
        in err
    )
    assert "both roles are built with --routed-experts-transfer" in err
    startup_check(json.loads(out))


def test_an_offload_child_without_the_switch_passes_the_startup_check() -> None:
    """Only a P/D carrier must have the switch; an offload child without it keeps
    its loads bounded. Negative control: NIXL without it is refused."""
    chain = multi_with_switch(NIXL_WITH_ROWS, OFFLOAD_1GIB)
    startup_check(chain)
    planted = json.loads(json.dumps(chain))
    del planted["kv_connector_extra_config"]["connectors"][0][
        "enable_routed_experts_transfer"
    ]
    planted["kv_connector_extra_config"]["connectors"][1][
        "enable_routed_experts_transfer"
    ] = True
    with pytest.raises(ValueError, match="not on its child NixlConnector"):
        startup_check(planted)


def test_the_startup_check_catches_a_chain_with_the_switch_on_one_level() -> None:
    """Negative control: the builder's chain minus the top-level switch is what the
    startup check refuses, so passing it above means something."""
    config = build_role_config(
        Deployment(
            pd=True, offload=Offload("mooncake", 1 << 30), routed_experts_transfer=True
        ),
        "decode",
    )
    planted = dict(config.kv_transfer_config)
    del planted["enable_routed_experts_transfer"]
    with pytest.raises(
        ValueError, match="child NixlConnector.* but not on the MultiConnector"
    ):
        startup_check(planted)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_off_by_default_leaves_no_switch_anywhere(role: str) -> None:
    code, out, _ = run_cli(["--role", role, "--offload", "native:1GiB"])
    assert code == 0
    assert "enable_routed_experts_transfer" not in out
    code, out, _ = run_cli(["--role", role, "--no-routed-experts-transfer"])
    assert code == 0
    assert "enable_routed_experts_transfer" not in out


def test_colocated_without_an_offload_is_refused() -> None:
    code, out, err = run_cli(["--role", "colocated", "--routed-experts-transfer"])
    assert code == 2
    assert out == ""
    assert "--routed-experts-transfer with --role colocated" in err
    assert "Drop --routed-experts-transfer" in err
    with pytest.raises(RoleConfigError, match="--routed-experts-transfer"):
        build_role_config(
            Deployment(pd=False, routed_experts_transfer=True), "colocated"
        )


def test_help_documents_the_flag() -> None:
    code, out, _ = run_cli(["--help"])
    assert code == 0
    assert "--routed-experts-transfer" in out
    assert "--enable-return-routed-experts" in " ".join(out.split())
