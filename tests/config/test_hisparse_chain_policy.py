"""HiSparse startup validation (patch 0010): the validation table through a real
VllmConfig on CPU, and the CUDA-graph default.

The chain checks run before vLLM 0.31.0's own HiSparse checks, the first of
which is the platform: on this CPU machine a chain that passes ours stops at
"HiSparse currently requires NVIDIA CUDA." That message is how an accepted row
shows it got past every chain rule; vLLM's later checks (PP, DCP, DSA model,
--scheduler-reserve-full-isl) are shown by pretending the platform is CUDA.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aux_gate_utils import _child, _config, _multi, _verify
from vllm.config import (
    AttentionConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.config.attention import HiSparseConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import chain_policy
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.chain_policy import (
    hisparse_cudagraph_default,
    verify_hisparse_chain,
)

CUDA_ONLY = "HiSparse currently requires NVIDIA CUDA."


NIXL = _child("NixlConnector", num_threads=1)
HISPARSE = _child("HiSparseConnector", host_pool_gib=8)
NATIVE = _child("OffloadingConnector", cpu_bytes_to_use=1 << 30)
MOONCAKE = _child("MooncakeStoreConnector")


def _kv(*children: dict[str, Any]) -> KVTransferConfig:
    """One connector bare, several in a MultiConnector."""
    return KVTransferConfig(**children[0]) if len(children) == 1 else _multi(*children)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.v1.tiny_moe import build
    path = tmp_path_factory.mktemp("tiny-moe")
    build(path, num_experts=8, num_experts_per_tok=2, seed=0)
    return path


def _vllm_config(moe_dir: Path, kv: KVTransferConfig | None, **overrides: Any) -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(model=str(moe_dir), dtype="float32", seed=0),
                      kv_transfer_config=kv, device_config=DeviceConfig("cpu"), **overrides)


OFFLOAD_MSG = ("HiSparseConnector cannot share a kv_transfer_config with {}: HiSparse keeps "
               "KV in a host-resident layout that KV offload does not carry")

# (chain, the error VllmConfig raises): our rejections, then rows our rules accept.
TABLE = [
    ((NIXL, HISPARSE, NATIVE), OFFLOAD_MSG.format("OffloadingConnector")),
    ((NIXL, MOONCAKE, HISPARSE), OFFLOAD_MSG.format("MooncakeStoreConnector")),
    ((HISPARSE, MOONCAKE), OFFLOAD_MSG.format("MooncakeStoreConnector")),  # colocated
    ((NATIVE, HISPARSE), OFFLOAD_MSG.format("OffloadingConnector")),  # colocated
    ((NIXL, HISPARSE, _child("SimpleCPUOffloadConnector")),
     OFFLOAD_MSG.format("SimpleCPUOffloadConnector")),
    ((NIXL, _child("HiSparseConnector")), "HiSparseConnector requires host_pool_gib"),
    ((NIXL, _child("HiSparseConnector", host_pool_gib=0)),
     "HiSparseConnector host_pool_gib must be positive"),
    ((NIXL, HISPARSE, HISPARSE), "Only one HiSparseConnector may be configured"),
    ((NIXL, HISPARSE), CUDA_ONLY),
    ((HISPARSE, NIXL), CUDA_ONLY),
    ((HISPARSE,), CUDA_ONLY),  # colocated, routed experts off: upstream behaviour
]


@pytest.mark.parametrize(("chain", "message"), TABLE,
                         ids=["+".join(c["kv_connector"] for c in row[0]) for row in TABLE])
def test_validation_table(moe_dir: Path, chain: tuple[dict[str, Any], ...],
                          message: str) -> None:
    with pytest.raises(ValueError, match="Value error, " + message.replace(".", r"\.")):
        _vllm_config(moe_dir, _kv(*chain))


def test_hisparse_config_without_its_connector_fails_at_startup(moe_dir: Path) -> None:
    """vLLM 0.31.0 finds this only when it sizes the KV cache, after the model loads."""
    with pytest.raises(ValueError, match="HiSparse requires HiSparseConnector with "
                                         "host_pool_gib; add"):
        _vllm_config(moe_dir, _kv(NIXL),
                     attention_config=AttentionConfig(hisparse_config=HiSparseConfig()))


@pytest.mark.parametrize("chain", [(NIXL, HISPARSE), (HISPARSE, NIXL),
                                   (_child("NixlPullConnector"), HISPARSE)])
def test_routed_experts_accept_hisparse_after_nixl(chain: tuple[dict[str, Any], ...]) -> None:
    verify_hisparse_chain(_kv(*chain), routed_experts=True, cudagraph_mode=None)


def test_routed_experts_gate_accepts_nixl_with_hisparse() -> None:
    """HiSparse loads no prefix, so the routed-experts gate lets it join NIXL."""
    _verify(_config(_kv(NIXL, HISPARSE)))


def test_routed_experts_reject_colocated_hisparse() -> None:
    with pytest.raises(ValueError, match="^--enable-return-routed-experts with HiSparse is "
                                         "supported on P/D decode instances only"):
        verify_hisparse_chain(_kv(HISPARSE), routed_experts=True, cudagraph_mode=None)
    # Negative control: the same chain is accepted with routed experts off.
    verify_hisparse_chain(_kv(HISPARSE), routed_experts=False, cudagraph_mode=None)


def test_vllm_config_passes_its_routed_experts_flag(moe_dir: Path) -> None:
    """The hook hands VllmConfig's own flag and graph mode to the check."""
    seen: dict[str, Any] = {}
    config = SimpleNamespace(kv_transfer_config=_kv(HISPARSE),
                             aux_output_config=SimpleNamespace(enabled=True),
                             model_config=SimpleNamespace(enforce_eager=True),
                             compilation_config=SimpleNamespace(
                                 cudagraph_mode=CUDAGraphMode.PIECEWISE))
    with pytest.raises(ValueError, match="supported on P/D decode instances only"):
        VllmConfig._verify_hisparse_chain(config)
    original = chain_policy.verify_hisparse_chain
    try:
        chain_policy.verify_hisparse_chain = lambda *a: seen.setdefault("args", a)
        VllmConfig._verify_hisparse_chain(config)
    finally:
        chain_policy.verify_hisparse_chain = original
    # enforce_eager: no graphs, so no graph-mode warning either.
    assert seen["args"][1:] == (True, CUDAGraphMode.NONE)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"parallel_config": ParallelConfig(pipeline_parallel_size=2)},
     "HiSparse does not support pipeline parallelism."),
    ({}, "HiSparse is only supported for DSA models with index_topk."),
])
def test_vllm_checks_after_ours_still_run(moe_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                          overrides: dict[str, Any], message: str) -> None:
    """With the platform check passed, vLLM's own HiSparse rules reject as before."""
    from vllm.platforms import current_platform
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        _vllm_config(moe_dir, _kv(NIXL, HISPARSE), **overrides)


@pytest.mark.parametrize(("chain", "mode", "expected"), [
    ((NIXL, HISPARSE), None, CUDAGraphMode.FULL_DECODE_ONLY),  # P/D decode: the default
    ((NIXL, HISPARSE), CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE),  # user's choice
    ((HISPARSE,), None, None),  # colocated: vLLM's default
    ((NIXL,), None, None),  # no HiSparse: untouched
    ((NIXL, NATIVE), CUDAGraphMode.FULL, CUDAGraphMode.FULL),
])
def test_cudagraph_default(chain: tuple[dict[str, Any], ...], mode: CUDAGraphMode | None,
                           expected: CUDAGraphMode | None) -> None:
    assert hisparse_cudagraph_default(_kv(*chain), mode) == expected


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize(("mode", "warns"), [
    (CUDAGraphMode.FULL_DECODE_ONLY, False), (CUDAGraphMode.NONE, False),
    (CUDAGraphMode.PIECEWISE, True), (CUDAGraphMode.FULL_AND_PIECEWISE, True),
    (CUDAGraphMode.FULL, True)])
def test_unvalidated_graph_modes_warn(mode: CUDAGraphMode, warns: bool) -> None:
    records = _Records()
    chain_policy.logger.addHandler(records)
    try:
        verify_hisparse_chain(_kv(NIXL, HISPARSE), routed_experts=True, cudagraph_mode=mode)
    finally:
        chain_policy.logger.removeHandler(records)
    expected = (f"HiSparse with cudagraph_mode={mode.name} is not validated; HiSparse on a "
                "P/D decode instance is validated with FULL_DECODE_ONLY (or NONE): set "
                "-cc.cudagraph_mode=FULL_DECODE_ONLY.")
    assert records.messages == ([expected] if warns else [])
