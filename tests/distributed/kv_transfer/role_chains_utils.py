"""Runs `vllm kv-transfer-config` in process, for the tests of role_chains.py
(test_role_chains.py, test_role_chains_from_docs.py)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from vllm.config import AuxOutputConfig, DeviceConfig, ModelConfig, VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
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


# vLLM 0.34.0 asks the platform; earlier releases require CUDA.
HISPARSE_ON_CPU = (
    "Value error, (HiSparse currently requires NVIDIA CUDA|"
    "The current platform does not support HiSparse)"
)


def accepted_chains(outputs: dict[str, Any]) -> list[str]:
    """The distinct kv_transfer_configs the command lines printed, as sorted JSON."""
    return sorted(
        {
            json.dumps(o["kv_transfer_config"], sort_keys=True)
            for o in outputs.values()
            if "error" not in o
        }
    )


def tiny_moe(path: Path) -> Path:
    """A tiny Qwen3-MoE (8 experts, top-2) at `path`, for configs that need a model."""
    from tools.testbed.tiny_moe import build

    build(path, num_experts=8, num_experts_per_tok=2, seed=0)
    return path


def chain_config(chain: str, model_dir: Path, *, routed_experts: bool) -> VllmConfig:
    """A VllmConfig on CPU with the printed chain (JSON) as its KV transfer config."""
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", seed=0),
        kv_transfer_config=KVTransferConfig(**json.loads(chain)),
        aux_output_config=AuxOutputConfig(enable_return_routed_experts=routed_experts),
        device_config=DeviceConfig("cpu"),
    )


def assert_chains_build(
    chains: list[str], model_dir: Path, *, routed_experts: bool
) -> None:
    """Each chain builds a VllmConfig on CPU; HiSparse chains pass the chain checks
    and stop at vLLM's CUDA check."""
    assert len(chains) >= 10
    for chain in chains:
        if "HiSparseConnector" in chain:
            with pytest.raises(ValueError, match=HISPARSE_ON_CPU):
                chain_config(chain, model_dir, routed_experts=routed_experts)
            continue
        config = chain_config(chain, model_dir, routed_experts=routed_experts)
        assert (
            config.kv_transfer_config.kv_connector == json.loads(chain)["kv_connector"]
        )
        assert config.aux_output_config.enable_return_routed_experts is routed_experts
