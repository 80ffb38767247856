"""`vllm kv-transfer-config --routed-experts-transfer` (patch
`transfer-routed-experts-rows-with-the-kv-over-nixl`): the P/D roles' chains with
`enable_routed_experts_transfer`, checked against JSON written by hand from the rule
in docs/r3-pd-rows-transfer.md (the switch on the config and, in a MultiConnector, on
its NixlConnector child; on a native offload child too, whose chunks carry rows since
patch `carry-routed-experts-rows-with-offloaded-kv-chunks`; on a Mooncake store
child since patch `store-routed-experts-rows-beside-mooncake-store`, which
stores each chunk's rows beside it), and against the startup check `vllm serve` runs
on the switch (`verify_routed_experts_transfer`), with a planted fault that check must
catch.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from types import SimpleNamespace
from typing import Any

import pytest

from tests.fork_base import HAS_OFFLOAD_ROWS, HAS_STORE_ROWS
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.role_chains import (
    Deployment,
    Offload,
    RoleConfigError,
    build_role_config,
)
from vllm.entrypoints.cli.kv_transfer_config import KVTransferConfigSubcommand

NIXL_WITH_ROWS = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"num_threads": 1},
    "enable_routed_experts_transfer": True,
}


OFFLOAD_1GIB = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
}


def multi_with_switch(*children: dict[str, Any]) -> dict[str, Any]:
    """A MultiConnector chain of `children` with the switch on its own config."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": list(children)},
        "enable_routed_experts_transfer": True,
    }


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`vllm kv-transfer-config ARGV` in process: exit code, stdout, stderr."""
    parser = argparse.ArgumentParser(prog="vllm")
    KVTransferConfigSubcommand().subparser_init(parser.add_subparsers())
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            args = parser.parse_args(["kv-transfer-config", *argv])
            KVTransferConfigSubcommand.cmd(args)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def startup_check(chain: dict[str, Any]) -> None:
    """What `vllm serve --enable-return-routed-experts` checks in the switch."""
    from vllm.distributed.aux_output_connector.rows_transfer_policy import (
        verify_routed_experts_transfer,
    )

    verify_routed_experts_transfer(
        KVTransferConfig(**chain),
        routed_experts_enabled=True,
        model_config=SimpleNamespace(is_hybrid=False),
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


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_multiconnector_sets_it_on_itself_and_its_carriers(role: str) -> None:
    config = build_role_config(
        Deployment(
            pd=True, offload=Offload("native", 1 << 30), routed_experts_transfer=True
        ),
        role,  # type: ignore[arg-type]
    )
    # The offload's chunks carry rows since that patch; before, only NIXL did.
    offload = OFFLOAD_1GIB | (
        {"enable_routed_experts_transfer": True} if HAS_OFFLOAD_ROWS else {}
    )
    assert config.kv_transfer_config == multi_with_switch(NIXL_WITH_ROWS, offload)
    startup_check(config.kv_transfer_config)


def test_the_mooncake_store_child_carries_rows_where_the_base_stores_them() -> None:
    """The Mooncake store child gets the switch where rows objects are stored beside
    its chunks; on a base without that patch it stays without it (bounded loads)."""
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
    if HAS_STORE_ROWS:
        assert children[1]["enable_routed_experts_transfer"] is True
    else:
        assert "enable_routed_experts_transfer" not in children[1]
    startup_check(config.kv_transfer_config)


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


def test_colocated_with_native_offload_sets_it_on_the_offload() -> None:
    code, out, err = run_cli(
        ["--role", "colocated", "--offload", "native:1GiB", "--routed-experts-transfer"]
    )
    if not HAS_OFFLOAD_ROWS:  # before rows travelled with offloaded chunks
        assert code == 2 and out == ""
        assert "--routed-experts-transfer with --role colocated" in err
        return
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


@pytest.mark.skipif(not HAS_STORE_ROWS, reason="refused on this base (test above)")
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


# Where the Mooncake store keeps rows beside its chunks, it carries them for a
# colocated role too; before, only the native offload did.
REFUSED_COLOCATED = [([], "no KV offload")] + (
    [] if HAS_STORE_ROWS else [(["--offload", "mooncake:1GiB"], "Mooncake store")]
)


@pytest.mark.parametrize(("offload", "named"), REFUSED_COLOCATED)
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
    if HAS_OFFLOAD_ROWS:
        assert f"--role colocated and {named}" in err
        assert "--offload native:SIZE" in err
    with pytest.raises(RoleConfigError, match="--routed-experts-transfer"):
        build_role_config(
            Deployment(pd=False, routed_experts_transfer=True), "colocated"
        )


def test_help_documents_the_flag() -> None:
    code, out, _ = run_cli(["--help"])
    assert code == 0
    assert "--routed-experts-transfer" in out
    assert "--enable-return-routed-experts" in " ".join(out.split())
