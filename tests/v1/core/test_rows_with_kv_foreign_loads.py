"""Rows are imported only from a load whose connector checked them.

With ``enable_routed_experts_transfer`` a P/D decode request's prompt rows arrive
in the rows mirror with its NIXL pull, which checks each block's slot before the
load counts. After a failed pull (recomputed) or a preemption, another connector
of decode's chain may load the prefix instead; that load brought no rows, and the
mirror slots of its blocks hold whatever an earlier pull left there. The scheduler
imports rows only when the connector that did the load vouches for them
(``KVConnectorBase_V1.loads_routed_experts_rows``): the NIXL pull that was sent
with its rows checks, an offload tier whose chunks carry rows. Before this, any
finished load of a marked P/D decode request was imported: a row read from
another block's slot, returned as this request's.

A real Scheduler with a MultiConnector: NIXL first (rows transfer on), then a
loader defined here that offers the whole prefix once armed and brings no rows
(it declares BOUNDED_LOADS, as every loader the startup check accepts, but the
test makes it ignore its bound: the worst case). Expected values are derived by
hand: 70-token prompt, 16-token blocks, rows from position 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.v1.aux_scheduler_utils import make_request, make_scheduler, runner_output
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVTransferKind,
    RoutedExpertsSupport,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.usefixtures("scheduler_env")

PROMPT = [(7 * i) % 300 + 3 for i in range(70)]  # 4 blocks of 16 and 6 tokens
FOREIGN_HIT = 48  # three whole blocks, all past the rows start (0)


class ForeignLoader(KVConnectorBase_V1):
    """A KV loader that brings no routed-experts rows: a hit of FOREIGN_HIT
    tokens, loaded asynchronously, once `armed` (class-level: the scheduler
    builds its own instance)."""

    kv_transfer_kind = KVTransferKind.KV_OFFLOAD
    routed_experts_support = RoutedExpertsSupport.BOUNDED_LOADS
    armed = False

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not ForeignLoader.armed or num_computed_tokens >= FOREIGN_HIT:
            return 0, False
        return FOREIGN_HIT - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


@pytest.fixture
def decode(model_dir: Path) -> Scheduler:
    ForeignLoader.armed = False
    children = [
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_consumer",
        },
        {
            "kv_connector": "ForeignLoader",
            "kv_connector_module_path": __name__,
            "kv_role": "kv_consumer",
        },
    ]
    yield make_scheduler(
        model_dir,
        KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_consumer",
            kv_connector_extra_config={"connectors": children},
            kv_load_failure_policy="recompute",
        ),
        rows_transfer=True,
        rows_transfer_children=(0,),
    )
    ForeignLoader.armed = False


def pd_request() -> Any:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_request_id": "prefill-d",
        "remote_block_ids": [[1, 2, 3, 4, 5]],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
    }
    return make_request("d", PROMPT, prompt_start=0, kv_transfer_params=params)


def pull(scheduler: Scheduler, *, fail: bool, prefix_elsewhere: bool = False) -> Any:
    """Schedule the NIXL pull of "d" and report it landed (every block invalid
    when `fail`); with `prefix_elsewhere` the other loader offers the prefix
    from then on. Return the next step's output."""
    scheduler.add_request(pd_request())
    out = scheduler.schedule()
    assert scheduler.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ForeignLoader.armed = prefix_elsewhere
    invalid = set(scheduler.kv_cache_manager.get_block_ids("d")[0]) if fail else None
    scheduler.update_from_output(
        out, runner_output(scheduler, out, recving={"d"}, invalid=invalid)
    )
    return scheduler.schedule()


def test_a_pull_sent_with_its_checks_imports_its_rows(decode: Scheduler) -> None:
    """The control: the NIXL pull vouches for its rows; they are imported from
    the rows start (0) to where the pull ended: the whole 70-token prompt, in
    its 5 blocks (prefill computed every prompt position)."""
    out = pull(decode, fail=False)
    rows_import = out.aux_output_connector_metadata.rows_imports["d"]
    block_ids = decode.kv_cache_manager.get_block_ids("d")[0]
    assert (rows_import.start, rows_import.end) == (0, 70)
    assert rows_import.block_ids == tuple(block_ids[:5])
    assert out.num_scheduled_tokens["d"] == 1


def test_a_load_by_a_connector_that_brings_no_rows_is_never_imported(
    decode: Scheduler,
) -> None:
    """The pull fails (recomputed: nothing of it counts) and the other loader
    offers the prefix. Whether its load is refused (a base that caps external
    hits at the rows it has) or taken, no rows are imported for it, in any step
    until the request ends."""
    out = pull(decode, fail=True, prefix_elsewhere=True)
    imported: list[str] = []
    for _ in range(8):
        meta = out.aux_output_connector_metadata
        imported += [rid for rid in meta.rows_imports if rid == "d"]
        waiting = decode.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        decode.update_from_output(
            out, runner_output(decode, out, recving={"d"} if waiting else None)
        )
        if "d" not in decode.requests:
            break
        out = decode.schedule()
    assert "d" not in decode.requests  # it ran to the end
    assert imported == []
