"""A real Scheduler with routed experts on, and the worker side it talks to, for CPU
tests.

Every setting goes into the config before VllmConfig validates it, routed experts
and the rows-transfer switch included; nothing runs a model. Tests that build one
use the `scheduler_env` fixture (tests/v1/conftest.py) for what routed experts
need of the process (Model Runner V2), set and undone by monkeypatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm import SamplingParams
from vllm.config import (
    AuxOutputConfig,
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager


def make_scheduler(
    model_dir: Path,
    kv_transfer_config: KVTransferConfig,
    *,
    block_size: int = 16,
    num_blocks: int = 100,
    aux: bool = True,
    rows_transfer: bool = False,
    rows_transfer_children: tuple[int, ...] = (),
) -> Scheduler:
    """`rows_transfer_children`: the MultiConnector children (by index) that carry
    the rows, which get the switch with the MultiConnector's config."""
    if rows_transfer:
        kv_transfer_config = with_rows_transfer(
            kv_transfer_config, rows_transfer_children
        )
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=512,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=kv_transfer_config,
        aux_output_config=AuxOutputConfig(enable_return_routed_experts=aux),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
    )
    assert (scheduler.aux_output_connector is not None) is aux
    return scheduler


def with_rows_transfer(
    kv_transfer_config: KVTransferConfig, children: tuple[int, ...]
) -> KVTransferConfig:
    """The config with the rows-transfer switch on, and on the MultiConnector
    children at the `children` indices."""
    extra = dict(kv_transfer_config.kv_connector_extra_config)
    if children:
        connectors = [dict(child) for child in extra["connectors"]]
        for index in children:
            connectors[index]["enable_routed_experts_transfer"] = True
        extra["connectors"] = connectors
    return dataclasses.replace(
        kv_transfer_config,
        enable_routed_experts_transfer=True,
        kv_connector_extra_config=extra,
    )


def offload_scheduler(
    model_dir: Path,
    *,
    block_size: int = 16,
    num_blocks: int = 12,
    aux: bool = True,
    rows_transfer: bool = False,
    policy: str = "fail",
    **extra: Any,
) -> Scheduler:
    """A scheduler with the native OffloadingConnector (16 MiB CPU tier)."""
    return make_scheduler(
        model_dir,
        KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 24, **extra},
            kv_load_failure_policy=policy,
        ),
        block_size=block_size,
        num_blocks=num_blocks,
        aux=aux,
        rows_transfer=rows_transfer,
    )


def nixl_decode_scheduler(
    model_dir: Path, policy: str = "fail", *, aux: bool = True
) -> Scheduler:
    """A decode instance's scheduler: NixlConnector as kv_consumer."""
    return make_scheduler(
        model_dir,
        KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_consumer",
            kv_load_failure_policy=policy,
        ),
        aux=aux,
    )


def make_request(
    rid: str,
    prompt: list[int],
    *,
    block_size: int = 16,
    max_tokens: int = 3,
    prompt_start: int = 0,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Request:
    init_none_hash(sha256)
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, routed_experts_prompt_start=prompt_start
    )
    params.update_from_generation_config({}, 2)
    request = Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    request.kv_transfer_params = kv_transfer_params
    return request


def runner_output(
    scheduler: Scheduler,
    scheduler_output: Any,
    *,
    recving: set[str] | None = None,
    invalid: set[int] | None = None,
) -> ModelRunnerOutput:
    """What the worker would return: rows from the emit start to this chunk's end."""
    ids = list(scheduler_output.num_scheduled_tokens)
    meta = scheduler_output.aux_output_connector_metadata
    emit_starts = meta.requests if meta is not None else {}
    aux = {}
    for rid in ids:
        # schedule() has already advanced num_computed_tokens past this chunk.
        end = scheduler.requests[rid].num_computed_tokens
        start = emit_starts[rid]
        # A Python int, as the real worker emits (test_pd_partial_block checks it).
        aux[rid] = AuxRequestOutput(
            start, np.full((end - start, 2, 2), start % 8, np.uint8)
        )
    kv = None
    if recving is not None or invalid is not None:
        kv = KVConnectorOutput(
            finished_recving=recving or set(), invalid_block_ids=invalid or set()
        )
    output = plain_runner_output(scheduler_output, kv)
    output.aux_output_connector_output = aux
    return output


def plain_runner_output(
    scheduler_output: Any, kv: KVConnectorOutput | None = None
) -> ModelRunnerOutput:
    """What a worker returns with routed experts off: one token per scheduled
    request, and the connector output given."""
    ids = list(scheduler_output.num_scheduled_tokens)
    index: dict[str, Any] = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        # A field before vLLM 0.34.0, which derives the index from req_ids.
        index["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(
        req_ids=ids,
        **index,
        sampled_token_ids=[[9] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv,
    )


def step(scheduler: Scheduler, **kwargs: Any) -> tuple[dict[str, int], list[Any]]:
    """One schedule + update; returns the emit starts sent to the worker and the
    outputs."""
    out = scheduler.schedule()
    meta = out.aux_output_connector_metadata
    engine = scheduler.update_from_output(out, runner_output(scheduler, out, **kwargs))
    emitted = [o for outputs in engine.values() for o in outputs.outputs]
    return (dict(meta.requests) if meta else {}), emitted


class StoreLookupFake:
    """A Mooncake store lookup client for scheduler tests (nothing connects to a
    master): its store holds every full block, and every block's rows object, or
    with `empty` nothing. It answers as the store worker's lookup does: the hit is
    the longest run of stored full blocks among `block_hashes`, and a hit that
    reaches `num_tokens` (the request's end) backs off one block, so the last token
    is recomputed. Each lookup is recorded as (num_tokens, number of hashes,
    rows_from)."""

    block_size = 16
    empty = False
    lookups: list[tuple[int, int, int | None]] = []

    def __init__(self, vllm_config: Any) -> None:
        pass

    @classmethod
    def reset(cls, block_size: int) -> None:
        cls.block_size, cls.empty, cls.lookups = block_size, False, []

    def lookup(
        self,
        req_id: str,
        num_tokens: int,
        block_hashes: list[bytes],
        non_block: bool = False,
        rows_from: int | None = None,
    ) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            MooncakeLookupResult,
        )

        self.lookups.append((num_tokens, len(block_hashes), rows_from))
        bs = self.block_size
        hit = 0 if self.empty else min(num_tokens // bs, len(block_hashes)) * bs
        if hit >= num_tokens:
            hit = (num_tokens - 1) // bs * bs
        return MooncakeLookupResult(hit)

    def discard(self, req_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def mooncake_store_scheduler(
    model_dir: Path,
    monkeypatch: Any,
    block_size: int,
    *,
    policy: str = "fail",
    load_async: bool = True,
    **defaults: Any,
) -> Callable[..., Scheduler]:
    """A builder of real Schedulers with MooncakeStoreConnector whose store lookups
    go to StoreLookupFake, with kv_load_failure_policy `policy` and the store's
    `load_async`; `defaults`, then the builder's keyword arguments, go to
    make_scheduler."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
        scheduler as store_sched,
    )

    monkeypatch.setattr(store_sched, "LookupKeyClient", StoreLookupFake)
    StoreLookupFake.reset(block_size)

    def build(**kwargs: Any) -> Scheduler:
        return make_scheduler(
            model_dir,
            KVTransferConfig(
                kv_connector="MooncakeStoreConnector",
                kv_role="kv_both",
                kv_connector_extra_config={"load_async": load_async},
                kv_load_failure_policy=policy,
            ),
            block_size=block_size,
            **{**defaults, **kwargs},
        )

    return build
