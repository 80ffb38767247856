"""`vllm kv-transfer-config` and role_chains.py (patch
`add-vllm-kv-transfer-config-per-role-p-d-connector`): every role x offload x
HiSparse combination against a regression snapshot, and each accepted chain through
vLLM's own config parsing.

golden/kv_transfer_config.json is a REGRESSION SNAPSHOT, not an independent
expectation: the code itself wrote it (`UPDATE_GOLDENS=1 pytest
tests/distributed/kv_transfer/test_role_chains.py`), so it pins today's behaviour
on 422 command lines (the printed --kv-transfer-config, Mooncake client file and
summary, or the error) and shows any change as a diff to review like code, but it
proves nothing about correctness. The expectations written by hand from the rules
in docs/deployments/ are in test_role_chains_from_docs.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.kv_transfer.role_chains_utils import (
    _parser,
    accepted_chains,
    assert_chains_build,
    run_cli,
    tiny_moe,
)
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.role_chains import (
    OFF,
    Deployment,
    Offload,
    RoleConfigError,
    build_role_config,
    effective_offload,
    parse_bytes,
    parse_offload,
)
from vllm.entrypoints.cli.kv_transfer_config import KVTransferConfigSubcommand

GOLDEN = Path(__file__).parent / "golden" / "kv_transfer_config.json"
OFFLOADS = ["off", "native:1GiB", "mooncake:1GiB", "mooncake:0"]
OVERRIDES = ["inherit", "off", "native:2GiB", "mooncake:0", "mooncake:2GiB"]


def _matrix() -> list[list[str]]:
    """Every role x shared offload x per-role override x HiSparse, plus the
    save_decode_cache switch and the override flags on a colocated role."""
    cases: list[list[str]] = []
    for shared, hisparse in itertools.product(OFFLOADS, (None, "4")):
        tail = ["--hisparse-host-pool-gib", hisparse] if hisparse else []
        cases.append(["--role", "colocated", "--offload", shared, *tail])
    for role, shared, pre, dec, hisparse in itertools.product(
        ("prefill", "decode"), OFFLOADS, OVERRIDES, OVERRIDES, (None, "4")
    ):
        tail = ["--hisparse-host-pool-gib", hisparse] if hisparse else []
        cases.append(
            [
                "--role",
                role,
                "--offload",
                shared,
                "--prefill-offload",
                pre,
                "--decode-offload",
                dec,
                *tail,
            ]
        )
    for role, shared, flag in itertools.product(
        ("colocated", "prefill", "decode"),
        ("native:1GiB", "mooncake:1GiB"),
        ("--save-decode-cache", "--no-save-decode-cache"),
    ):
        cases.append(["--role", role, "--offload", shared, flag])
    cases.append(
        ["--role", "colocated", "--offload", "native:1GiB", "--decode-offload", "off"]
    )
    cases.append(
        [
            "--role",
            "decode",
            "--offload",
            "mooncake:1GiB",
            "--nixl-threads",
            "4",
            "--mooncake-master",
            "10.0.0.1:50051",
            "--mooncake-protocol",
            "tcp",
        ]
    )
    return cases


def diff_against_golden(outputs: dict[str, Any], golden: dict[str, Any]) -> list[str]:
    diffs = [f"missing from golden: {key}" for key in outputs if key not in golden]
    diffs += [f"no longer produced: {key}" for key in golden if key not in outputs]
    diffs += [
        f"{key}:\n  got    {json.dumps(outputs[key])}\n  golden "
        f"{json.dumps(golden[key])}"
        for key in outputs
        if key in golden and outputs[key] != golden[key]
    ]
    return diffs


def _all_outputs() -> dict[str, Any]:
    return {" ".join(argv): run_cli(argv) for argv in _matrix()}


SNAPSHOT_ABOUT = (
    "Regression snapshot written by the code under test (UPDATE_GOLDENS=1 pytest "
    "tests/distributed/kv_transfer/test_role_chains.py): it pins the builder's "
    "output per command line but is not an independent expectation; the hand-derived "
    "cases are in tests/distributed/kv_transfer/test_role_chains_from_docs.py."
)


def read_snapshot() -> dict[str, Any]:
    """The snapshot's outputs, keyed by command line."""
    return json.loads(GOLDEN.read_text())["outputs"]


@pytest.fixture(scope="module")
def outputs() -> dict[str, Any]:
    return _all_outputs()


def test_every_combination_matches_its_golden(outputs: dict[str, Any]) -> None:
    if os.environ.get("UPDATE_GOLDENS"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        snapshot = {"about": SNAPSHOT_ABOUT, "outputs": outputs}
        GOLDEN.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
    assert json.loads(GOLDEN.read_text())["about"] == SNAPSHOT_ABOUT
    golden = read_snapshot()
    assert diff_against_golden(outputs, golden) == []
    accepted = [o for o in outputs.values() if "error" not in o]
    # The matrix exercises both outcomes in numbers, not a handful of cases.
    assert len(accepted) > 150 and len(outputs) - len(accepted) > 150


def _nixl(**extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_threads": 1, **extra},
    }


def test_examples_from_the_spec() -> None:
    """A few outputs spelled out in full, so the golden file is not the only record."""
    assert run_cli(["--role", "prefill"])["kv_transfer_config"] == _nixl()
    decode = run_cli(
        [
            "--role",
            "decode",
            "--offload",
            "mooncake:64GiB",
            "--decode-offload",
            "mooncake:0",
            "--hisparse-host-pool-gib",
            "8",
        ]
    )
    assert decode == {
        "error": (
            "decode role: vllm serve rejects this chain: HiSparseConnector cannot "
            "share a "
            "kv_transfer_config with MooncakeStoreConnector: HiSparse keeps KV in a "
            "host-resident layout that KV offload does not carry (the Mooncake store "
            "would "
            "mix it with regular payloads under the same keys). Remove "
            "MooncakeStoreConnector from this instance's chain; keep KV offload on the "
            "prefill instances. Options behind this chain: MooncakeStoreConnector from "
            "--decode-offload mooncake:0 (--decode-offload off removes it from this "
            "role), "
            "HiSparseConnector from --hisparse-host-pool-gib 8."
        )
    }
    decode = run_cli(
        [
            "--role",
            "decode",
            "--offload",
            "mooncake:64GiB",
            "--decode-offload",
            "mooncake:0",
        ]
    )
    assert decode["kv_transfer_config"] == {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                _nixl(),
                {
                    "kv_connector": "MooncakeStoreConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"save_decode_cache": True},
                },
            ]
        },
    }
    assert decode["mooncake_config"] == {
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": "127.0.0.1:50051",
        "protocol": "rdma",
        "device_name": "",
        "mode": "standalone-store",
        "global_segment_size": 0,
    }
    prefill = run_cli(
        [
            "--role",
            "prefill",
            "--offload",
            "mooncake:64GiB",
            "--decode-offload",
            "mooncake:0",
        ]
    )
    assert prefill["mooncake_config"]["mode"] == "embedded"
    assert prefill["mooncake_config"]["global_segment_size"] == 64 << 30
    assert (
        prefill["kv_transfer_config"]["kv_connector_extra_config"]["connectors"][1][
            "kv_connector_extra_config"
        ]
        == {}
    )
    hisparse = run_cli(
        [
            "--role",
            "decode",
            "--prefill-offload",
            "native:1GiB",
            "--hisparse-host-pool-gib",
            "8",
        ]
    )
    assert hisparse["kv_transfer_config"]["kv_connector_extra_config"][
        "connectors"
    ] == [
        _nixl(),
        {
            "kv_connector": "HiSparseConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"host_pool_gib": 8.0},
        },
    ]
    assert hisparse["summary"] == (
        "decode: NixlConnector (P/D KV transfer) -> HiSparseConnector (8 GiB host pool)"
    )


def test_unset_inherits_and_off_disables() -> None:
    shared = Offload("native", 1 << 30)
    deployment = Deployment(pd=True, offload=shared, decode_offload=OFF)
    assert effective_offload(deployment, "prefill") == shared
    assert effective_offload(deployment, "decode") is None
    assert build_role_config(deployment, "decode").kv_transfer_config == _nixl()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("512MiB", 512 << 20),
        ("64GiB", 64 << 30),
        ("64GB", 64 << 30),
        ("1.5g", 3 << 29),
        ("4096", 4096),
    ],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_bytes(text, "--offload") == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("native", "--offload: 'native' is not an offload; write off, native:<bytes>"),
        ("lmcache:1GiB", "--offload: 'lmcache:1GiB' is not an offload"),
        ("native:lots", "--offload: cannot read 'lots' as a size"),
    ],
)
def test_bad_offload_specs_name_the_option(text: str, message: str) -> None:
    with pytest.raises(
        RoleConfigError,
        match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*"),
    ):
        parse_offload(text, "--offload")


def test_a_bad_spec_on_the_command_line_exits_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(
            ["kv-transfer-config", "--role", "decode", "--decode-offload", "native"]
        )
    assert exc.value.code == 2
    assert "--decode-offload: 'native' is not an offload" in capsys.readouterr().err


def test_emit_mooncake_config_for_a_role_without_it_is_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parser().parse_args(
        ["kv-transfer-config", "--role", "prefill", "--emit", "mooncake-config"]
    )
    with pytest.raises(SystemExit):
        KVTransferConfigSubcommand.cmd(args)
    assert (
        "--emit mooncake-config: the prefill role does not use the Mooncake store"
        in capsys.readouterr().err
    )


def test_mooncake_client_settings_are_read_as_the_store_client_reads_them() -> None:
    base = ["--role", "decode", "--offload", "mooncake:1GiB"]
    assert (
        run_cli([*base, "--mooncake-local-buffer", "2GB"])["mooncake_config"][
            "local_buffer_size"
        ]
        == "2GB"
    )
    assert run_cli([*base, "--mooncake-local-buffer", "lots"]) == {
        "error": "decode role: the Mooncake client file does not load with vLLM's "
        "MooncakeStoreConfig.from_file: Invalid format: 'lots'; check "
        "--mooncake-local-buffer 'lots' (a size such as 512MB or 1GB)"
    }


def test_the_hisparse_rules_are_vllm_serves_own_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The builder runs verify_hisparse_chain (what vllm serve runs) on the decode
    chain instead of restating its rules: a rule planted there reaches the builder."""
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import chain_policy

    seen: list[list[str]] = []

    def planted(kv_transfer_config: KVTransferConfig, **kwargs: Any) -> None:
        seen.append([name for name, _ in chain_policy.chain_kinds(kv_transfer_config)])
        raise ValueError("planted HiSparse rule")

    monkeypatch.setattr(chain_policy, "verify_hisparse_chain", planted)
    result = run_cli(["--role", "decode", "--hisparse-host-pool-gib", "8"])
    assert result == {
        "error": "decode role: vllm serve rejects this chain: planted "
        "HiSparse rule Options behind this chain: HiSparseConnector from "
        "--hisparse-host-pool-gib 8."
    }
    assert seen == [["NixlConnector", "HiSparseConnector"]]
    # Chains without HiSparse are not given to the HiSparse check.
    assert "error" not in run_cli(["--role", "decode", "--offload", "native:1GiB"])
    assert len(seen) == 1


def test_only_builder_errors_become_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cmd turns RoleConfigError into exit 2; any other exception is a bug and
    propagates."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("kv_connector")

    monkeypatch.setattr(
        "vllm.entrypoints.cli.kv_transfer_config.build_role_config", broken
    )
    args = _parser().parse_args(["kv-transfer-config", "--role", "prefill"])
    with pytest.raises(KeyError):
        KVTransferConfigSubcommand.cmd(args)


def _parser_options() -> set[str]:
    """Every option string `vllm kv-transfer-config` takes."""
    parent = argparse.ArgumentParser(prog="vllm")
    sub = KVTransferConfigSubcommand().subparser_init(parent.add_subparsers())
    return {option for action in sub._actions for option in action.option_strings}


def test_every_flag_a_message_names_exists(outputs: dict[str, Any]) -> None:
    """Each --flag in an error message is an option of this command (or
    --kv-transfer-config, the vllm serve option the output is for)."""
    options = _parser_options() | {"--kv-transfer-config"}
    messages = {o["error"] for o in outputs.values() if "error" in o}
    messages.add(
        run_cli(["--role", "prefill", "--prefill-offload", "native:0"])["error"]
    )
    named = {flag for text in messages for flag in re.findall(r"--[a-z][a-z-]*", text)}
    assert named - options == set()
    assert {
        "--role",
        "--offload",
        "--decode-offload",
        "--prefill-offload",
        "--hisparse-host-pool-gib",
        "--save-decode-cache",
    } <= named


def _vllm_help(flag: str) -> str:
    """`vllm kv-transfer-config <flag>` from the installed entry point, unwrapped."""
    sibling = Path(sys.executable).parent / "vllm"  # this interpreter's vllm first
    vllm = str(sibling) if sibling.exists() else shutil.which("vllm") or "vllm"
    text = subprocess.run(
        [vllm, "kv-transfer-config", flag],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    return " ".join(text.split())  # argparse wraps lines


def test_the_vllm_command_has_the_subcommand() -> None:
    """The installed `vllm` entry point has it. Plain --help is vLLM's group index
    (FlexibleArgumentParser), whose usage line and group summaries name every
    option; --help=all and --help=<group> give each option's text."""
    words = _vllm_help("--help")
    for option in (
        "--role {prefill,decode,colocated}",
        "[--offload SPEC]",
        "[--prefill-offload SPEC]",
        "[--decode-offload SPEC]",
        "[--save-decode-cache | --no-save-decode-cache]",
        "[--hisparse-host-pool-gib GIB]",
        "[--nixl-threads N]",
        "[--emit {kv-transfer-config,mooncake-config,all}]",
        "[--mooncake-master HOST:PORT]",
        "[--mooncake-metadata-server URL]",
        "[--mooncake-protocol {rdma,tcp}]",
        "[--mooncake-device NAME]",
        "[--mooncake-local-buffer SIZE]",
    ):
        assert option in words, option
    for option in _parser_options() - {"-h", "--help"}:
        assert option in words, option
    assert "Config Groups: options deployment The role and the deployment" in words
    assert "vllm kv-transfer-config --help=all" in words
    inherit = "inherit (default), off (none for this role even when --offload is set)"
    assert inherit not in words  # option texts are on --help=all / --help=<group>
    assert inherit in _vllm_help("--help=all")
    group = _vllm_help("--help=mooncake-client")
    assert "--mooncake-local-buffer SIZE The client's local transfer buffer" in group
    assert "--role" not in group


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


def test_every_accepted_chain_passes_vllm_config_on_cpu(
    outputs: dict[str, Any], moe_dir: Path
) -> None:
    """Each distinct printed chain builds a VllmConfig; HiSparse chains pass the
    chain checks and stop at vLLM's CUDA check. (With routed experts on too:
    test_role_chains_routed_experts.py.)"""
    assert_chains_build(accepted_chains(outputs), moe_dir, routed_experts=False)
