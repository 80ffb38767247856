"""MooncakeStoreScheduler with routed-experts rows stored beside the chunks (patch
`store-routed-experts-rows-beside-mooncake-store`), through a real Scheduler.

With `enable_routed_experts_transfer` the lookup is no longer clamped at the block
holding `routed_experts_prompt_start`: it gets every block hash and the first
position whose rows a load must bring, and the store worker ends the hit at the
first chunk past it without a rows object. The load's metadata names, for each
destination block whose rows the request emits, the token chain its rows object must
carry; a store's metadata names the chains of the blocks it stores. Chains are
derived here with hashlib from the spec (rows_transfer.py's docstring).

The lookup client is a fake whose store holds every block with its rows
(aux_scheduler_utils.StoreLookupFake), and which records each lookup; nothing
connects to a Mooncake master.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.rows_spec import spec_chains
from tests.v1.aux_scheduler_utils import (
    StoreLookupFake,
    make_request,
    mooncake_store_scheduler,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

pytestmark = [pytest.mark.usefixtures("scheduler_env")]

BS = 16
PROMPT = [(13 * i) % 400 + 4 for i in range(84)]  # 5 full blocks + 4 tokens


CHAINS = spec_chains(PROMPT, BS)[:5]  # the full blocks


@pytest.fixture
def store_scheduler(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Scheduler]:
    return mooncake_store_scheduler(model_dir, monkeypatch, BS, rows_transfer=True)


def request_metas(scheduler_output: Any, req_id: str) -> list[Any]:
    meta = scheduler_output.kv_connector_metadata
    return [m for m in meta.requests if m.req_id == req_id]


@pytest.mark.parametrize(
    ("prompt_start", "needed"),
    [
        # (block index, first position of the block whose rows are needed)
        (0, [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)]),
        (40, [(2, 8), (3, 0), (4, 0)]),  # block 2 holds position 40
        (80, []),  # the load ends at 80: no loaded position has rows to return
    ],
)
def test_the_load_names_the_rows_each_loaded_block_must_carry(
    store_scheduler: Callable[..., Scheduler],
    prompt_start: int,
    needed: list[tuple[int, int]],
) -> None:
    scheduler = store_scheduler()
    request = make_request("r", PROMPT, block_size=BS, prompt_start=prompt_start)
    scheduler.add_request(request)
    out = scheduler.schedule()
    # Every hash is looked up, with the first position whose rows a load must
    # bring; the whole stored prefix loads (the last token is recomputed).
    assert StoreLookupFake.lookups[0] == (84, 5, prompt_start)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == 80
    (req_meta,) = request_metas(out, "r")
    block_ids = scheduler.kv_cache_manager.get_block_ids("r")[0]
    checks = req_meta.rows.checks if req_meta.rows is not None else ()
    assert [(index, check.block_id) for index, check in checks] == [
        (index, block_ids[index]) for index, _ in needed
    ]
    assert [check.chain for _, check in checks] == [CHAINS[i] for i, _ in needed]
    assert [(check.need_lo, check.need_hi) for _, check in checks] == [
        (lo, BS) for _, lo in needed
    ]


def test_a_store_names_the_chains_of_the_blocks_it_stores(
    store_scheduler: Callable[..., Scheduler],
) -> None:
    StoreLookupFake.empty = True
    scheduler = store_scheduler()
    request = make_request("r", PROMPT, block_size=BS, prompt_start=0)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert StoreLookupFake.lookups[0] == (84, 5, 0)
    assert out.num_scheduled_tokens["r"] == 84
    (req_meta,) = request_metas(out, "r")
    # Nothing loads; the store of the computed prompt carries the chains of its 5
    # full blocks, all computed by this step (so their rows are waited for).
    assert req_meta.can_save
    assert req_meta.rows is not None
    assert req_meta.rows.checks == ()
    assert list(req_meta.rows.chains) == CHAINS
    assert req_meta.rows.computed_from == 0


def test_without_the_switch_the_lookup_stays_clamped(
    store_scheduler: Callable[..., Scheduler],
) -> None:
    """Negative control: without rows beside the chunks, a request that returns
    rows from position 40 looks up only the two blocks before it, with no rows
    position, and its metadata names no rows."""
    scheduler = store_scheduler(rows_transfer=False)
    request = make_request("r", PROMPT, block_size=BS, prompt_start=40)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert StoreLookupFake.lookups[0] == (84, 2, None)
    assert request.num_computed_tokens == 32
    assert all(m.rows is None for m in request_metas(out, "r"))


@pytest.mark.parametrize("rows_transfer", [True, False])
def test_synchronous_loads_are_refused_with_the_switch_at_startup(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, rows_transfer: bool
) -> None:
    """A synchronous load's rows are never imported: before, every request that
    loaded KV failed in the worker's output. Without the switch (the control)
    synchronous loads stay allowed."""
    build = mooncake_store_scheduler(
        model_dir, monkeypatch, BS, load_async=False, rows_transfer=rows_transfer
    )
    if not rows_transfer:
        assert build().connector is not None
        return
    with pytest.raises(
        ValueError,
        match=r"needs kv_connector_extra_config\.load_async=true \(the default\)",
    ):
        build()
