"""The decode emit floor through a real Scheduler with a NixlConnector kv_consumer.

Drives the remote-prefill lifecycle as a decode instance sees it: the request
waits for its KV, the pull finishes, the first forward is at P - 1, rows are
emitted from there, and the floor is gone when the request finishes. Also the
failed-load recompute path and preemption.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tiny_moe import build  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BS = 16
PROMPT = 21  # first forward at 20: mid-block


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe")
    build(path, num_experts=8, num_experts_per_tok=2, seed=0)
    return path


@pytest.fixture(autouse=True)
def _no_mrv2_at_config_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Recorded by monkeypatch, so make_scheduler's switch to MRV2 is undone after each test.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")


def make_scheduler(model_dir: Path, policy: str = "fail") -> Scheduler:
    """A decode-instance scheduler with routed experts on.

    The config is built with routed experts off (so without MRV2, which CPU
    validation refuses unless the process started with the Triton opt-in), then
    they are switched on and the scheduler is built for MRV2, which routed
    experts require; nothing runs a model here.
    """
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                         max_model_len=512, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector",
                                            kv_role="kv_consumer",
                                            kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"),
    )
    config.aux_output_config.enable_return_routed_experts = True
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # undone by the autouse fixture
    config.cache_config.num_gpu_blocks = 100
    kv = KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv, log_stats=True,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=BS)
    assert scheduler.aux_output_connector is not None
    return scheduler


def decode_request(rid: str, max_tokens: int = 3) -> Request:
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, 2)
    request = Request(request_id=rid, prompt_token_ids=[(7 * i) % 500 + 4 for i in range(PROMPT)],
                      sampling_params=params, pooling_params=None, mm_features=None,
                      block_hasher=get_request_block_hasher(BS, sha256))
    request.kv_transfer_params = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
        "remote_request_id": f"prefill-{rid}", "remote_block_ids": [0, 1],
        "remote_host": "127.0.0.1", "remote_port": 1234, "tp_size": 1,
    }
    return request


def runner_output(scheduler: Scheduler, scheduler_output: Any, *,
                  recving: set[str] | None = None, invalid: set[int] | None = None) -> ModelRunnerOutput:
    """What the worker would return: rows from the emit start to this chunk's end."""
    ids = list(scheduler_output.num_scheduled_tokens)
    emit_starts = scheduler_output.aux_output_connector_metadata.requests
    aux = {}
    for rid in ids:
        # schedule() has already advanced num_computed_tokens past this chunk.
        end = scheduler.requests[rid].num_computed_tokens
        start = emit_starts[rid]
        aux[rid] = AuxRequestOutput(start, np.full((end - start, 2, 2), start % 8, np.uint8))
    kv = None
    if recving is not None or invalid is not None:
        kv = KVConnectorOutput(finished_recving=recving or set(), invalid_block_ids=invalid or set())
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[9] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None,
                             kv_connector_output=kv, aux_output_connector_output=aux)


def step(scheduler: Scheduler, **kwargs: Any) -> tuple[dict[str, int], list[Any]]:
    out = scheduler.schedule()
    meta = out.aux_output_connector_metadata
    engine = scheduler.update_from_output(out, runner_output(scheduler, out, **kwargs))
    emitted = [o for outputs in engine.values() for o in outputs.outputs]
    return (dict(meta.requests) if meta else {}), emitted


def pull_finished(scheduler: Scheduler, rid: str, fail_first_block: bool = False) -> None:
    out = scheduler.schedule()  # the request waits for its KV
    assert scheduler.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not out.aux_output_connector_metadata or not out.aux_output_connector_metadata.requests
    invalid = None
    if fail_first_block:
        invalid = {scheduler.kv_cache_manager.get_block_ids(rid)[0][0]}
    scheduler.update_from_output(out, runner_output(scheduler, out, recving={rid}, invalid=invalid))


def test_floor_at_the_first_forward_and_cleanup_at_finish(model_dir: Path) -> None:
    scheduler = make_scheduler(model_dir)
    scheduler.add_request(decode_request("d"))
    pull_finished(scheduler, "d")
    emit, outputs = step(scheduler)
    assert emit == {"d": PROMPT - 1}
    assert scheduler.aux_output_connector._decode_emit_floors == {"d": PROMPT - 1}
    [first] = outputs
    assert first.routed_experts_start == PROMPT - 1 and len(first.routed_experts) == 1
    positions = [first.routed_experts_start]
    while scheduler.requests.get("d") is not None:
        emit, outputs = step(scheduler)
        positions += [o.routed_experts_start for o in outputs]
    assert positions == [PROMPT - 1, PROMPT, PROMPT + 1]
    assert scheduler.aux_output_connector._decode_emit_floors == {}


def test_failed_load_with_recompute_lowers_the_floor(model_dir: Path) -> None:
    scheduler = make_scheduler(model_dir, policy="recompute")
    scheduler.add_request(decode_request("d"))
    request = scheduler.requests["d"]
    pull_finished(scheduler, "d", fail_first_block=True)
    assert request.num_computed_tokens == 0
    emit, outputs = step(scheduler)
    assert emit == {"d": 0}  # decode recomputes, and returns, the whole prompt
    assert outputs[0].routed_experts_start == 0 and len(outputs[0].routed_experts) == PROMPT


def test_floor_survives_preemption_and_abort_cleans_up(model_dir: Path) -> None:
    scheduler = make_scheduler(model_dir)
    scheduler.add_request(decode_request("d", max_tokens=10))
    pull_finished(scheduler, "d")
    step(scheduler)
    request = scheduler.requests["d"]
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())
    assert scheduler.aux_output_connector._decode_emit_floors == {"d": PROMPT - 1}
    emit, outputs = step(scheduler)
    # Resumed with one output: stock num_tokens - 1 dominates the floor.
    assert emit == {"d": request.num_tokens - 2}
    assert outputs[0].routed_experts_start == PROMPT
    scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert scheduler.aux_output_connector._decode_emit_floors == {}


def test_no_floors_leak_after_many_requests(model_dir: Path) -> None:
    scheduler = make_scheduler(model_dir)
    for i in range(40):
        scheduler.add_request(decode_request(f"d{i}", max_tokens=2))
        if i % 4 == 3:
            scheduler.finish_requests(f"d{i}", RequestStatus.FINISHED_ABORTED)  # before any step
    for _ in range(200):
        if not scheduler.requests:
            break
        out = scheduler.schedule()
        waiting = {r.request_id for r in scheduler.waiting
                   if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
        waiting |= {rid for rid, r in scheduler.requests.items()
                    if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
        scheduler.update_from_output(out, runner_output(scheduler, out, recving=waiting))
    assert not scheduler.requests
    assert scheduler.aux_output_connector._decode_emit_floors == {}
