"""The P/D decode emit floor in AuxOutputSchedulerConnector (patch
`emit-p-d-decode-routed-experts-from-the-decode`).

Requests are plain namespaces carrying what the connector reads; a step is a
namespace with `num_scheduled_tokens`. Each case states the positions.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

DECODE_PARAMS = {
    "do_remote_prefill": False,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-0",
    "_remote_blocks_processed": True,
}
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
}


@dataclass
class FakeRequest:
    request_id: str
    num_tokens: int
    num_computed_tokens: int
    num_output_tokens: int = 0
    prompt_start: int = 0
    kv_transfer_params: dict[str, Any] | None = field(
        default_factory=lambda: dict(DECODE_PARAMS)
    )
    finished: bool = False
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_tokens - self.num_output_tokens

    @property
    def sampling_params(self) -> SimpleNamespace:
        return SimpleNamespace(routed_experts_prompt_start=self.prompt_start)

    def is_finished(self) -> bool:
        return self.finished


def _connector() -> AuxOutputSchedulerConnector:
    """The connector alone; on 0.33 it also reads the KV cache manager's block pool,
    which here holds nothing (no block is cached, so no rows are retained)."""
    if (
        "kv_cache_manager"
        not in inspect.signature(AuxOutputSchedulerConnector).parameters
    ):
        return AuxOutputSchedulerConnector()
    pool = SimpleNamespace(
        hash_block_size=1, get_cached_block=lambda block_hash, groups: None
    )
    coordinator = SimpleNamespace(
        single_type_managers=[SimpleNamespace(block_size=1, block_pool=pool)]
    )
    return AuxOutputSchedulerConnector(
        SimpleNamespace(  # type: ignore[arg-type]
            coordinator=coordinator,
            block_pool=pool,
            kv_cache_config=SimpleNamespace(num_blocks=8),
        )
    )


def _step(
    connector: AuxOutputSchedulerConnector,
    *requests: FakeRequest,
    kv_connector: bool = True,
) -> dict[str, int]:
    # A scheduler with a KV connector (every P/D one) attaches its metadata first.
    output = SimpleNamespace(
        num_scheduled_tokens={r.request_id: 1 for r in requests},
        kv_connector_metadata=object() if kv_connector else None,
    )
    meta = connector.build_connector_meta(output, {r.request_id: r for r in requests})
    return meta.requests


def test_first_forward_sets_the_floor() -> None:
    # P = 6, tokens [0, 5) pulled from prefill, first forward at 5.
    connector = _connector()
    request = FakeRequest("r", num_tokens=6, num_computed_tokens=5)
    assert _step(connector, request) == {"r": 5}


def test_stock_start_without_pd_params_is_unchanged() -> None:
    connector = _connector()
    plain = FakeRequest(
        "plain", num_tokens=6, num_computed_tokens=5, kv_transfer_params=None
    )
    prefill = FakeRequest(
        "prefill",
        num_tokens=6,
        num_computed_tokens=0,
        kv_transfer_params=dict(PREFILL_PARAMS),
    )
    assert _step(connector, plain, prefill) == {"plain": 0, "prefill": 0}
    assert connector._decode_emit_floors == {}


def test_no_floor_is_looked_up_without_a_kv_connector() -> None:
    # Without a KV connector no request is P/D (build_connector_meta skips the
    # per-request test): the stock start, nothing recorded.
    connector = _connector()
    request = FakeRequest("r", num_tokens=6, num_computed_tokens=5)
    assert _step(connector, request, kv_connector=False) == {"r": 0}
    assert connector._decode_emit_floors == {}
    assert _step(connector, request) == {"r": 5}  # the same request, with one


def test_floor_survives_preemption() -> None:
    connector = _connector()
    request = FakeRequest(
        "r", num_tokens=6, num_computed_tokens=5, block_hashes=[b"a" * 32]
    )
    assert _step(connector, request) == {"r": 5}
    # Preempted before its first output: still running, computed reset to 0.
    connector.request_finished(request)
    request.num_computed_tokens = 0
    assert _step(connector, request) == {"r": 5}


def test_after_the_first_output_the_stock_start_dominates() -> None:
    connector = _connector()
    request = FakeRequest("r", num_tokens=6, num_computed_tokens=5)
    _step(connector, request)
    request.num_tokens, request.num_output_tokens, request.num_computed_tokens = 9, 3, 8
    assert _step(connector, request) == {"r": 8}
    # Resumed after preemption with outputs: stock num_tokens - 1, not the floor.
    connector.request_finished(request)
    request.num_computed_tokens = 0
    assert _step(connector, request) == {"r": 8}


@pytest.mark.parametrize(
    ("num_computed", "prompt_start", "expected"),
    [
        (4, 0, 4),  # prefill back-off b = 1 (Mamba hybrid): F = P - 2 here with P = 6
        (0, 0, 0),  # failed load, recompute everything: decode emits the prompt rows
        (0, 3, 3),  # ... from routed_experts_prompt_start
        (5, 5, 5),  # s = F
        (2, 4, 4),  # s > F: the stock term wins
        (5, 6, 6),  # s = P
    ],
)
def test_floor_edge_cases(num_computed: int, prompt_start: int, expected: int) -> None:
    connector = _connector()
    request = FakeRequest(
        "r", num_tokens=6, num_computed_tokens=num_computed, prompt_start=prompt_start
    )
    assert _step(connector, request) == {"r": expected}


def test_finish_drops_the_floor() -> None:
    connector = _connector()
    request = FakeRequest(
        "r", num_tokens=6, num_computed_tokens=5, block_hashes=[b"a" * 32]
    )
    _step(connector, request)
    request.finished = True
    connector.request_finished(request)
    assert connector._decode_emit_floors == {}


def test_abort_after_preemption_without_hashes_in_flight_drops_the_floor() -> None:
    # No hashes were ever sent, so upstream's request_finished returns early.
    connector = _connector()
    request = FakeRequest("r", num_tokens=6, num_computed_tokens=5)
    _step(connector, request)
    connector.request_finished(request)  # preemption
    request.finished = True
    connector.request_finished(request)  # abort while waiting
    assert connector._decode_emit_floors == {}


def test_reset_keeps_floors() -> None:
    connector = _connector()
    request = FakeRequest("r", num_tokens=6, num_computed_tokens=5)
    _step(connector, request)
    connector.reset()
    request.num_computed_tokens = 0
    assert _step(connector, request) == {"r": 5}


def test_no_floor_leaks_after_many_requests() -> None:
    connector = _connector()
    for index in range(500):
        request = FakeRequest(
            f"r{index}",
            num_tokens=20 + index % 7,
            num_computed_tokens=19 + index % 7,
            block_hashes=[bytes([index % 256]) * 32],
        )
        _step(connector, request)
        if index % 3 == 0:
            connector.request_finished(request)  # preempted once
        request.finished = True
        connector.request_finished(request)
    _step(connector)
    assert connector._decode_emit_floors == {}
    assert connector._sent_hash_counts == {}
