# SPDX-License-Identifier: Apache-2.0
"""A real vLLM Scheduler on the tiny model's config: a library of scheduler_step and
offload_rows_limit_walk, not a script. It imports vllm only when called, so the
vllm that runs is the caller's (scheduler_step's children put their own first)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def make_scheduler(model: Path, aux: bool, num_requests: int,
                   kv_transfer_config: Any = None, rows_transfer: bool = False) -> Any:
    """A real Scheduler on the tiny model's config (one 16-token full-attention
    group), with `kv_transfer_config`'s connector if given (and its routed-experts
    rows transfer switched on with `rows_transfer`)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    # The config is validated for the V1 model runner: stock's CPU build rejects Model
    # Runner V2 for lack of Triton (the fork's patch 0001 adds an opt-in). The scheduler
    # then runs as under MRV2, the runner routed experts need: it reads this live.
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    model_config = ModelConfig(model=str(model), dtype="float32", seed=0)
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=num_requests,
                                         max_num_batched_tokens=8192, max_model_len=4096,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    # Model Runner V2 (routed experts need it); from vLLM 0.34.0 on it is the only
    # runner and the config no longer says so.
    assert getattr(config, "use_v2_model_runner", True)
    config.aux_output_config.enable_return_routed_experts = aux
    if rows_transfer:
        config.kv_transfer_config.enable_routed_experts_transfer = True
    num_blocks = num_requests * 64
    config.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    return Scheduler(vllm_config=config, kv_cache_config=kv, log_stats=False,
                     structured_output_manager=StructuredOutputManager(config), block_size=16)
