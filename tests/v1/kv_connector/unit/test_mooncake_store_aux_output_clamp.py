"""The routed-experts load limit in MooncakeStoreScheduler (patch
`bound-offload-loads-to-positions-without-routed`), through a real Scheduler: the
lookup itself is clamped, so the LoadSpec the connector records agrees with what
update_state_after_alloc asserts.

The store client is replaced by a fake whose store holds every block it is asked
about, and which records each lookup; nothing connects to a Mooncake master.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.v1.aux_scheduler_utils import (
    StoreLookupFake,
    make_request,
    mooncake_store_scheduler,
)
from tests.v1.kv_connector.unit.mooncake_store_retry_utils import (
    request_fails_at_its_first_chunk,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.usefixtures("scheduler_env")

BS = 16
PROMPT = [(13 * i) % 400 + 4 for i in range(84)]  # 5 full blocks + 4 tokens
PD_DECODE = {
    "do_remote_prefill": False,
    "do_remote_decode": False,
    "remote_engine_id": "p0",
}


@pytest.fixture
def store_scheduler(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Scheduler]:
    return mooncake_store_scheduler(model_dir, monkeypatch, BS, aux=True)


@pytest.mark.parametrize(
    ("prompt_start", "params", "loaded", "lookup"),
    [
        # Only the blocks before s are looked up, with the request's own length: a
        # clamped window that hits in full loads in full.
        (64, None, 64, (84, 4, None)),
        (70, None, 64, (84, 4, None)),
        (84, None, 80, (84, 5, None)),
        (0, PD_DECODE, 80, (84, 5, None)),  # P/D decode: the whole request, as stock
    ],
)
def test_lookup_is_clamped_and_the_load_matches_it(
    store_scheduler: Callable[..., Scheduler],
    prompt_start: int,
    params: dict | None,
    loaded: int,
    lookup: tuple[int, int, int | None],
) -> None:
    scheduler = store_scheduler()
    request = make_request(
        "r",
        PROMPT,
        block_size=BS,
        prompt_start=prompt_start,
        kv_transfer_params=dict(params) if params else None,
    )
    scheduler.add_request(request)
    assert scheduler.connector.get_num_new_matched_tokens(request, 0) == (loaded, True)
    spec = scheduler.connector.connector_scheduler.load_specs["r"]
    assert (spec.vllm_cached_tokens, spec.kvpool_cached_tokens) == (0, loaded)
    # Through the scheduler, which runs update_state_after_alloc and its assertion that
    # the allocation matches the LoadSpec.
    scheduler.schedule()
    assert StoreLookupFake.lookups == [lookup, lookup]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == loaded


def test_nothing_to_load_skips_the_lookup_and_the_load_spec(
    store_scheduler: Callable[..., Scheduler],
) -> None:
    scheduler = store_scheduler()
    request = make_request("r", PROMPT, block_size=BS, prompt_start=10)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert StoreLookupFake.lookups == []
    assert "r" not in scheduler.connector.connector_scheduler.load_specs
    assert out.num_scheduled_tokens["r"] == len(PROMPT)


def test_without_routed_experts_the_lookup_is_stock(
    store_scheduler: Callable[..., Scheduler],
) -> None:
    """Negative control: unclamped, the same request loads 80 tokens."""
    scheduler = store_scheduler(aux=False)
    request = make_request("r", PROMPT, block_size=BS, prompt_start=10)
    scheduler.add_request(request)
    scheduler.schedule()
    assert StoreLookupFake.lookups == [(84, 5, None)]
    assert request.num_computed_tokens == 80


def test_a_failed_first_chunk_is_recomputed_with_routed_experts_on(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With routed experts on, a request that returns no prompt rows (start 84) is
    looked up in full, so a failed first chunk goes as without them
    (end-store-lookups-before-chunks-whose-load-failed): the same lookups, the
    same loads, recomputed and finished in 4 steps."""
    build = mooncake_store_scheduler(
        model_dir, monkeypatch, BS, policy="recompute", aux=True
    )
    scheduler = build()
    assert scheduler.aux_output_connector is not None
    request_fails_at_its_first_chunk(scheduler, caplog)
