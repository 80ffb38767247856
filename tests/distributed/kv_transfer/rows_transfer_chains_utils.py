"""Helpers for the tests of `vllm kv-transfer-config --routed-experts-transfer`: the
chains written by hand from the rule in docs/r3-pd-rows-transfer.md, the command run
in process, and the startup check `vllm serve` runs on the switch."""

from __future__ import annotations

import argparse
import contextlib
import io
from types import SimpleNamespace
from typing import Any

from vllm.config.kv_transfer import KVTransferConfig
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
