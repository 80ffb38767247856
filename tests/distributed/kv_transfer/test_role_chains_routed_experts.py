"""Every chain `vllm kv-transfer-config` prints passes VllmConfig with routed experts
on (patches `allow-routed-experts-capture-with-nixlconnector-p-d` and
`bound-offload-loads-to-positions-without-routed`: P/D over NIXL, the native offload
and the Mooncake store are accepted beside routed-experts capture).

The chains are the builder's, as pinned by its regression snapshot
(tests/distributed/kv_transfer/golden/kv_transfer_config.json, which
test_role_chains.py checks against the builder's output); the expectation, that
each passes the routed-experts checks of a real VllmConfig on CPU, is vLLM's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.kv_transfer.role_chains_utils import (
    accepted_chains,
    assert_chains_build,
    tiny_moe,
)

GOLDEN = Path(__file__).parent / "golden" / "kv_transfer_config.json"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


def test_every_accepted_chain_passes_with_routed_experts_on(
    moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Routed experts need Model Runner V2; where the config checks that it has
    # Triton (vLLM 0.31.0), CPU counts Triton only with the import-time opt-in.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr("vllm.config.vllm.HAS_TRITON", True, raising=False)
    chains = accepted_chains(json.loads(GOLDEN.read_text())["outputs"])
    assert_chains_build(chains, moe_dir, routed_experts=True)
