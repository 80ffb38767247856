"""Runs `vllm kv-transfer-config` in process, for the tests of role_chains.py
(test_role_chains.py, test_role_chains_from_docs.py)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from typing import Any

from vllm.entrypoints.cli.kv_transfer_config import KVTransferConfigSubcommand


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm")
    KVTransferConfigSubcommand().subparser_init(
        parser.add_subparsers(dest="subcommand")
    )
    return parser


def run_cli(argv: list[str]) -> dict[str, Any]:
    """One `vllm kv-transfer-config ... --emit all`, in process: its JSON or its
    error."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            args = _parser().parse_args(["kv-transfer-config", *argv, "--emit", "all"])
            KVTransferConfigSubcommand.cmd(args)
        except SystemExit as exc:
            assert exc.code == 2, f"{argv}: exit {exc.code}"
            last = err.getvalue().strip().splitlines()[-1]
            return {"error": last.split("error: ", 1)[1]}
    result = json.loads(out.getvalue())
    result["summary"] = (
        err.getvalue().splitlines()[0].removeprefix("kv-transfer-config: ")
    )
    return result
