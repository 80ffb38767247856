"""HiSparse startup validation (patch validate-hisparse-connector-chains-at-startup):
the validation table through a real VllmConfig on CPU, and the CUDA-graph default.

The chain checks run after vLLM's own HiSparse checks (CUDA, PP, DCP,
--scheduler-reserve-full-isl, a DSA model), so vLLM's messages come first, as
upstream's tests expect. To reach ours on this CPU machine, the table pretends the
platform is CUDA and gives the tiny model an ``index_topk`` (the DSA marker). Rows
our rules accept are checked on the rule itself (``verify_hisparse_chain``), since
past our check VllmConfig goes on into CUDA-only setup.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.config.aux_gate_utils import LogRecords, _child, _config, _multi, _verify
from vllm.config import (
    AttentionConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.attention import HiSparseConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import chain_policy
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.chain_policy import (
    hisparse_cudagraph_default,
    verify_hisparse_chain,
)
from vllm.platforms.interface import Platform

# vLLM's own refusal off CUDA: 0.34.0 asks the platform for a HiSparse backend,
# earlier bases require CUDA by name.
NOT_ON_THIS_PLATFORM = (
    "The current platform does not support HiSparse."
    if hasattr(Platform, "get_hisparse_backend_cls")
    else "HiSparse currently requires NVIDIA CUDA."
)
CUDA_HISPARSE_BACKEND = "vllm.v1.hisparse.backend.CUDAHiSparseBackend"


NIXL = _child("NixlConnector", num_threads=1)
HISPARSE = _child("HiSparseConnector", host_pool_gib=8)
NATIVE = _child("OffloadingConnector", cpu_bytes_to_use=1 << 30)
MOONCAKE = _child("MooncakeStoreConnector")


def _kv(*children: dict[str, Any]) -> KVTransferConfig:
    """One connector bare, several in a MultiConnector."""
    return KVTransferConfig(**children[0]) if len(children) == 1 else _multi(*children)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.testbed.tiny_moe import build

    path = tmp_path_factory.mktemp("tiny-moe")
    build(path, num_experts=8, num_experts_per_tok=2, seed=0)
    return path


@pytest.fixture(scope="module")
def dsa_dir(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's config with vLLM's DSA marker (index_topk); config only."""
    path = tmp_path_factory.mktemp("tiny-dsa")
    config = json.loads((moe_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "index_topk": 4}))
    return path


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Pretends the platform is CUDA (with Triton, which HiSparse's Model Runner V2
    needs) once `_vllm_config` has built the model config: model inspection on CPU
    must see the real platform."""
    return monkeypatch


def _vllm_config(
    moe_dir: Path,
    kv: KVTransferConfig | None,
    cuda: pytest.MonkeyPatch | None = None,
    **overrides: Any,
) -> VllmConfig:
    model_config = ModelConfig(model=str(moe_dir), dtype="float32", seed=0)
    if cuda is not None:
        from vllm.platforms import current_platform

        # Import the connectors on the real platform: on vLLM 0.34.0 NIXL's
        # import chain reaches the attention backends, which pick CUDA kernels
        # when the platform says CUDA.
        importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl")
        cuda.setattr(current_platform, "is_cuda", lambda: True)
        # vLLM 0.34.0 asks the platform for its HiSparse backend.
        cuda.setattr(
            current_platform,
            "get_hisparse_backend_cls",
            lambda: CUDA_HISPARSE_BACKEND,
            raising=False,
        )
        # As upstream's tests do; vLLM 0.34.0's config no longer reads it.
        cuda.setattr("vllm.config.vllm.HAS_TRITON", True, raising=False)
        # Skip the HMA auto-detect, which imports CUDA attention extensions (as
        # upstream's HiSparse tests do).
        overrides.setdefault(
            "scheduler_config",
            SchedulerConfig(
                max_model_len=model_config.max_model_len,
                is_encoder_decoder=False,
                disable_hybrid_kv_cache_manager=False,
            ),
        )
    return VllmConfig(
        model_config=model_config,
        kv_transfer_config=kv,
        device_config=DeviceConfig("cpu"),
        **overrides,
    )


OFFLOAD_MSG = (
    "HiSparseConnector cannot share a kv_transfer_config with {}: HiSparse keeps "
    "KV in a host-resident layout that KV offload does not carry"
)

# (chain, the error our rules raise through VllmConfig).
REJECTED = [
    ((NIXL, HISPARSE, NATIVE), OFFLOAD_MSG.format("OffloadingConnector")),
    ((NIXL, MOONCAKE, HISPARSE), OFFLOAD_MSG.format("MooncakeStoreConnector")),
    ((HISPARSE, MOONCAKE), OFFLOAD_MSG.format("MooncakeStoreConnector")),  # colocated
    ((NATIVE, HISPARSE), OFFLOAD_MSG.format("OffloadingConnector")),  # colocated
    (
        (NIXL, HISPARSE, _child("SimpleCPUOffloadConnector")),
        OFFLOAD_MSG.format("SimpleCPUOffloadConnector"),
    ),
    ((NIXL, _child("HiSparseConnector")), "HiSparseConnector requires host_pool_gib"),
    (
        (NIXL, _child("HiSparseConnector", host_pool_gib=0)),
        "HiSparseConnector host_pool_gib must be positive",
    ),
    ((NIXL, HISPARSE, HISPARSE), "Only one HiSparseConnector may be configured"),
]
ACCEPTED = [
    (NIXL, HISPARSE),
    (HISPARSE, NIXL),
    (_child("NixlPullConnector"), HISPARSE),
    (HISPARSE,),
]  # colocated, routed experts off: upstream behaviour


def _ids(rows: list[Any]) -> list[str]:
    return [
        "+".join(
            c["kv_connector"] for c in (row[0] if isinstance(row[0], tuple) else row)
        )
        for row in rows
    ]


@pytest.mark.parametrize(("chain", "message"), REJECTED, ids=_ids(REJECTED))
def test_rejected_chains(
    dsa_dir: Path,
    cuda: pytest.MonkeyPatch,
    chain: tuple[dict[str, Any], ...],
    message: str,
) -> None:
    with pytest.raises(ValueError, match="Value error, " + message.replace(".", r"\.")):
        _vllm_config(dsa_dir, _kv(*chain), cuda)


@pytest.mark.parametrize("chain", ACCEPTED, ids=_ids(ACCEPTED))
def test_accepted_chains(chain: tuple[dict[str, Any], ...]) -> None:
    verify_hisparse_chain(_kv(*chain), cudagraph_mode=None)


@pytest.mark.parametrize(
    ("cuda_platform", "message"),
    [
        (False, NOT_ON_THIS_PLATFORM),
        (True, "HiSparse is only supported for DSA models with index_topk."),
    ],
)
def test_vllm_checks_come_before_ours(
    moe_dir: Path, monkeypatch: pytest.MonkeyPatch, cuda_platform: bool, message: str
) -> None:
    """A chain our rules reject still gets vLLM's own message first."""
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        _vllm_config(
            moe_dir, _kv(NIXL, HISPARSE, NATIVE), monkeypatch if cuda_platform else None
        )


def test_vllm_pp_check_also_comes_before_ours(
    dsa_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parallel_config = ParallelConfig(
        pipeline_parallel_size=2
    )  # sized on the real platform
    with pytest.raises(
        ValueError, match="HiSparse does not support pipeline parallelism"
    ):
        _vllm_config(
            dsa_dir,
            _kv(NIXL, HISPARSE, NATIVE),
            monkeypatch,
            parallel_config=parallel_config,
        )


def test_hisparse_config_without_its_connector_fails_at_startup(
    dsa_dir: Path, cuda: pytest.MonkeyPatch
) -> None:
    """VLLM 0.31.0 finds this only when it sizes the KV cache, after the model loads;
    vLLM 0.34.0 checks it at startup itself, before our chain check runs."""
    with pytest.raises(
        ValueError,
        match="HiSparse requires (HiSparseConnector with host_pool_gib; add|"
        "a KV transfer config with HiSparseConnector and host_pool_gib)",
    ):
        _vllm_config(
            dsa_dir,
            _kv(NIXL),
            cuda,
            attention_config=AttentionConfig(hisparse_config=HiSparseConfig()),
        )


def test_routed_experts_gate_accepts_nixl_with_hisparse() -> None:
    """HiSparse loads no prefix, so the routed-experts gate lets it join NIXL."""
    _verify(_config(_kv(NIXL, HISPARSE)))
    _verify(_config(_kv(HISPARSE, NIXL)))


def test_routed_experts_gate_rejects_colocated_hisparse() -> None:
    with pytest.raises(
        ValueError,
        match="^--enable-return-routed-experts with HiSparse is "
        "supported on P/D decode instances only",
    ):
        _verify(_config(_kv(HISPARSE)))
    # Negative control: the same chain is accepted with routed experts off.
    _verify(_config(_kv(HISPARSE), aux_output_config=SimpleNamespace(enabled=False)))


def test_vllm_config_passes_its_graph_mode() -> None:
    """The hook hands VllmConfig's graph mode to the check (NONE when eager)."""
    seen: dict[str, Any] = {}
    config = SimpleNamespace(
        kv_transfer_config=_kv(NIXL, HISPARSE),
        model_config=SimpleNamespace(enforce_eager=True),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.PIECEWISE),
    )
    original = chain_policy.verify_hisparse_chain
    try:
        chain_policy.verify_hisparse_chain = lambda *a: seen.setdefault("args", a)
        VllmConfig._verify_hisparse_chain(config)
        config.model_config.enforce_eager = False
        assert seen.pop("args")[1:] == (CUDAGraphMode.NONE,)
        VllmConfig._verify_hisparse_chain(config)
    finally:
        chain_policy.verify_hisparse_chain = original
    assert seen["args"][1:] == (CUDAGraphMode.PIECEWISE,)


@pytest.mark.parametrize(
    ("chain", "mode", "expected"),
    [
        (
            (NIXL, HISPARSE),
            None,
            CUDAGraphMode.FULL_DECODE_ONLY,
        ),  # P/D decode: the default
        (
            (NIXL, HISPARSE),
            CUDAGraphMode.PIECEWISE,
            CUDAGraphMode.PIECEWISE,
        ),  # user's choice
        ((HISPARSE,), None, None),  # colocated: vLLM's default
        ((NIXL,), None, None),  # no HiSparse: untouched
        ((NIXL, NATIVE), CUDAGraphMode.FULL, CUDAGraphMode.FULL),
    ],
)
def test_cudagraph_default(
    chain: tuple[dict[str, Any], ...],
    mode: CUDAGraphMode | None,
    expected: CUDAGraphMode | None,
) -> None:
    assert hisparse_cudagraph_default(_kv(*chain), mode) == expected


@pytest.mark.parametrize(
    ("mode", "warns"),
    [
        (CUDAGraphMode.FULL_DECODE_ONLY, False),
        (CUDAGraphMode.NONE, False),
        (CUDAGraphMode.PIECEWISE, True),
        (CUDAGraphMode.FULL_AND_PIECEWISE, True),
        (CUDAGraphMode.FULL, True),
    ],
)
def test_other_graph_modes_warn(mode: CUDAGraphMode, warns: bool) -> None:
    records = LogRecords()
    chain_policy.logger.addHandler(records)
    try:
        verify_hisparse_chain(_kv(NIXL, HISPARSE), cudagraph_mode=mode)
    finally:
        chain_policy.logger.removeHandler(records)
    expected = (
        f"HiSparse with cudagraph_mode={mode.name} has not been run with this chain "
        "policy; the reference HiSparse P/D decode deployment runs with "
        "FULL_DECODE_ONLY (or NONE), which has not been run on a GPU with this "
        "policy either: set -cc.cudagraph_mode=FULL_DECODE_ONLY to match it."
    )
    assert records.messages == ([expected] if warns else [])


@pytest.mark.parametrize(
    "name",
    [
        "OffloadingConnector",
        "MooncakeStoreConnector",
        "SimpleCPUOffloadConnector",
        "LMCacheConnectorV1",
        "FlexKVConnectorV1",
        "HF3FSKVConnector",
    ],
)
def test_kv_offload_connectors_declare_it(name: str) -> None:
    """The rule reads kv_transfer_kind, so each offload connector must declare it
    (LMCacheMPConnector's module needs lmcache to import, so it is not read here)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVTransferKind

    config = KVTransferConfig(kv_connector=name, kv_role="kv_both")
    connector_cls = KVConnectorFactory.declarations_class(config)
    assert connector_cls.kv_transfer_kind is KVTransferKind.KV_OFFLOAD
