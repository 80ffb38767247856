"""Requests that carry one KV hand-off (the children of an ``n > 1`` request on a
P/D decode instance) pull it once and share the landed blocks.

A real Scheduler with NixlConnector as kv_consumer, 16-token blocks and no model.
Three children carry their own copy of one hand-off (``remote_request_id`` names
it). Expected values are derived by hand from the block size: a prompt of P tokens
fills ceil(P / 16) blocks; the siblings adopt the landed prompt up to position
P - 1, so they share the first floor((P - 1) / 16) blocks and each gets its own
block for position P - 1 (a copy of the leader's when P - 1 falls inside it).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tests.v1.aux_scheduler_utils import (
    make_request,
    make_scheduler,
    nixl_decode_scheduler,
    plain_runner_output,
    step,
)
from vllm.config import KVTransferConfig
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.shared_loads import HandoffPrompt, SharedLoads, SharedLoadState
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.usefixtures("scheduler_env")

CHILDREN = ("0_group", "1_group", "2_group")
KEY = ("prefill-0", "prefill-request-7")
# One prompt of two full 16-token blocks, as the unit tests of SharedLoads see it.
PROMPT = HandoffPrompt(tuple(range(3, 35)), (b"block-0", b"block-1"))


def handoff(num_blocks: int) -> dict[str, Any]:
    """What prefill returned for one hand-off of ``num_blocks`` blocks."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_request_id": "prefill-request-7",
        "remote_block_ids": [list(range(1, num_blocks + 1))],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }


def decode_scheduler(model_dir: Path, policy: str = "recompute") -> Scheduler:
    return nixl_decode_scheduler(model_dir, policy, aux=False)


def add_group(scheduler: Scheduler, prompt_len: int) -> list[str]:
    prompt = [(5 * i) % 300 + 3 for i in range(prompt_len)]
    params = handoff(-(-prompt_len // 16))
    for rid in CHILDREN:
        scheduler.add_request(
            make_request(rid, prompt, kv_transfer_params=copy.deepcopy(params))
        )
    return list(CHILDREN)


def run(
    scheduler: Scheduler,
    recving: set[str] | None = None,
    invalid: set[int] | None = None,
) -> SchedulerOutput:
    out = scheduler.schedule()
    kv = None
    if recving is not None or invalid is not None:
        kv = KVConnectorOutput(
            finished_recving=recving or set(), invalid_block_ids=invalid or set()
        )
    scheduler.update_from_output(out, plain_runner_output(out, kv))
    return out


def pulls(out: SchedulerOutput) -> set[str]:
    meta = out.kv_connector_metadata
    return set(meta.reqs_to_recv) if meta is not None else set()


def block_ids(scheduler: Scheduler, rid: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(rid)[0])


def land(scheduler: Scheduler, prompt_len: int) -> SchedulerOutput:
    """Admit the group, finish the leader's pull; returns the adopting step."""
    add_group(scheduler, prompt_len)
    first = run(scheduler)
    assert pulls(first) == {CHILDREN[0]}
    leader = scheduler.requests[CHILDREN[0]]
    assert leader.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    for rid in CHILDREN[1:]:
        assert scheduler.requests[rid].status == RequestStatus.WAITING
        assert scheduler.kv_cache_manager.get_block_ids(rid) == ([],)
    run(scheduler, recving={CHILDREN[0]})
    return run(scheduler)


@pytest.mark.parametrize(
    ("prompt_len", "shared", "copied"),
    [
        # 70 tokens: 5 blocks; position 69 is in block 4, which holds 64..69.
        (70, 4, True),
        # 64 tokens: 4 blocks; position 63 ends block 3 (48..63), copied.
        (64, 3, True),
        # 65 tokens: 5 blocks; position 64 starts block 4: a fresh block.
        (65, 4, False),
    ],
)
def test_siblings_adopt_the_landed_blocks_of_one_pull(
    model_dir: Path, prompt_len: int, shared: int, copied: bool
) -> None:
    scheduler = decode_scheduler(model_dir)
    out = land(scheduler, prompt_len)
    leader = block_ids(scheduler, CHILDREN[0])
    assert len(leader) == -(-prompt_len // 16)
    assert pulls(out) == set()
    copies = []
    for rid in CHILDREN[1:]:
        sibling = block_ids(scheduler, rid)
        assert sibling[:shared] == leader[:shared]
        assert sibling[shared] not in leader
        request = scheduler.requests[rid]
        assert request.num_computed_tokens == prompt_len  # P - 1 adopted, 1 computed
        assert out.num_scheduled_tokens[rid] == 1
        assert not request.kv_transfer_params["do_remote_prefill"]
        copies.append((leader[shared], sibling[shared]))
    assert out.num_scheduled_tokens[CHILDREN[0]] == 1
    made = sorted(
        (made_copy.src_block_id, made_copy.dst_block_id)
        for made_copy in out.kv_cache_block_copies or ()
    )
    assert made == (sorted(copies) if copied else [])
    tails = {block_ids(scheduler, rid)[shared] for rid in CHILDREN}
    assert len(tails) == 3  # nobody writes P - 1 into another's block


def test_no_sibling_ever_pulls_or_notifies(model_dir: Path) -> None:
    scheduler = decode_scheduler(model_dir)
    land(scheduler, 70)
    for _ in range(4):
        assert pulls(run(scheduler)) == set()
    assert not scheduler.requests  # all three finished (3 tokens each)
    assert scheduler.kv_cache_manager.usage == 0.0


def test_an_aborted_sibling_does_not_notify_prefill(model_dir: Path) -> None:
    scheduler = decode_scheduler(model_dir)
    add_group(scheduler, 70)
    assert pulls(run(scheduler)) == {CHILDREN[0]}
    scheduler.finish_requests(CHILDREN[1], RequestStatus.FINISHED_ABORTED)
    # Prefill is notified by the leader's READ only; an aborted sibling that
    # never pulled would otherwise free prefill's blocks under the READ.
    assert pulls(run(scheduler)) == set()
    run(scheduler, recving={CHILDREN[0]})
    out = run(scheduler)
    assert set(out.num_scheduled_tokens) == {CHILDREN[0], CHILDREN[2]}


def test_the_last_member_aborted_before_any_pull_notifies_once(
    model_dir: Path,
) -> None:
    scheduler = decode_scheduler(model_dir)
    add_group(scheduler, 70)
    scheduler.finish_requests(list(CHILDREN), RequestStatus.FINISHED_ABORTED)
    # One empty READ (a notification) frees prefill's blocks; not three.
    meta = run(scheduler).kv_connector_metadata
    assert meta is not None
    assert len(meta.reqs_to_recv) == 1


def test_an_aborted_leader_leaves_its_siblings_to_compute(model_dir: Path) -> None:
    scheduler = decode_scheduler(model_dir)
    add_group(scheduler, 70)
    run(scheduler)
    scheduler.finish_requests(CHILDREN[0], RequestStatus.FINISHED_ABORTED)
    out = run(scheduler)
    # The hand-off is being read: the siblings never pull it again. The first
    # computes the prompt; the second hits its 4 full blocks, cached as they
    # were allocated, and computes the 6 tokens after them.
    assert pulls(out) == set()
    assert out.num_scheduled_tokens[CHILDREN[1]] == 70
    assert out.num_scheduled_tokens[CHILDREN[2]] == 70 - 64
    run(scheduler, recving={CHILDREN[0]})
    while scheduler.requests:
        run(scheduler)
    assert scheduler.kv_cache_manager.usage == 0.0


def test_a_failed_pull_shares_only_its_valid_prefix(model_dir: Path) -> None:
    scheduler = decode_scheduler(model_dir, policy="recompute")
    add_group(scheduler, 70)
    run(scheduler)
    leader = block_ids(scheduler, CHILDREN[0])
    # Block 2 (tokens 32..47) failed: 32 valid tokens, the rest recomputed.
    run(scheduler, recving={CHILDREN[0]}, invalid={leader[2]})
    out = run(scheduler)
    assert out.num_scheduled_tokens[CHILDREN[0]] == 70 - 32
    for rid in CHILDREN[1:]:
        assert block_ids(scheduler, rid)[:2] == leader[:2]
        assert out.num_scheduled_tokens[rid] == 70 - 32
        assert not out.kv_cache_block_copies
    while scheduler.requests:
        run(scheduler)
    assert scheduler.kv_cache_manager.usage == 0.0


def test_a_late_request_with_a_read_handoff_never_pulls(model_dir: Path) -> None:
    scheduler = decode_scheduler(model_dir)
    land(scheduler, 70)
    while scheduler.requests:
        run(scheduler)
    prompt = [(5 * i) % 300 + 3 for i in range(70)]
    scheduler.add_request(make_request("late", prompt, kv_transfer_params=handoff(5)))
    out = run(scheduler)
    assert pulls(out) == set()
    # Computed here: from the prefix cache the group left (4 full blocks).
    assert out.num_scheduled_tokens["late"] == 70 - 64
    assert not scheduler.requests["late"].kv_transfer_params["do_remote_prefill"]


def test_the_pin_holds_the_landing_until_the_last_sibling(model_dir: Path) -> None:
    # 6 usable blocks (block 0 is the pool's null block): the leader's 5 and
    # one more, so one sibling adopts (its copy of block 4 takes the last free
    # block) and the other waits for a block, holding nothing.
    scheduler = make_scheduler(
        model_dir,
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer"),
        num_blocks=7,
        aux=False,
    )
    shared_loads = scheduler.shared_loads
    assert shared_loads is not None
    out = land(scheduler, 70)
    assert set(out.num_scheduled_tokens) == {CHILDREN[0], CHILDREN[1]}
    assert shared_loads.num_pins() == 1
    assert scheduler.requests[CHILDREN[2]].num_computed_tokens == 0
    while CHILDREN[2] not in out.num_scheduled_tokens:
        out = run(scheduler)
    assert shared_loads.num_pins() == 0
    assert out.num_scheduled_tokens[CHILDREN[2]] == 1  # it adopted too
    while scheduler.requests:
        run(scheduler)
    assert scheduler.kv_cache_manager.usage == 0.0


def test_a_pin_no_sibling_takes_lapses_with_the_lease() -> None:
    loads = SharedLoads(lease_seconds=30)
    for rid in CHILDREN:
        loads.add(rid, KEY, PROMPT)
    loads.started(CHILDREN[0], load_kv_async=True)
    assert loads.state(CHILDREN[1]) == SharedLoadState.WAIT
    blocks = ([KVCacheBlock(block_id=3), KVCacheBlock(block_id=4)],)
    assert loads.land(CHILDREN[0], blocks, 20, False, now=100.0)
    assert loads.state(CHILDREN[1]) == SharedLoadState.ADOPT
    assert loads.expire(now=129.9) == []
    assert loads.num_pins() == 1
    unpinned = loads.expire(now=130.0)
    assert [[b.block_id for b in group] for group in unpinned[0]] == [[3, 4]]
    assert loads.state(CHILDREN[1]) == SharedLoadState.CONSUMED
    assert loads.num_pins() == 0


def test_heartbeats_go_on_while_any_member_holds_the_handoff(
    model_dir: Path,
) -> None:
    scheduler = decode_scheduler(model_dir)
    add_group(scheduler, 70)
    nixl = scheduler.connector.connector_scheduler  # type: ignore[union-attr]
    scheduler.finish_requests(CHILDREN[2], RequestStatus.FINISHED_ABORTED)
    assert nixl._heartbeat_by_engine["prefill-0"].req_ids == {"prefill-request-7"}
    scheduler.finish_requests(
        [CHILDREN[0], CHILDREN[1]], RequestStatus.FINISHED_ABORTED
    )
    assert "prefill-0" not in nixl._heartbeat_by_engine


def test_every_sibling_imports_the_rows_the_pull_brought(model_dir: Path) -> None:
    scheduler = make_scheduler(
        model_dir,
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer"),
        rows_transfer=True,
    )
    add_group(scheduler, 70)
    step(scheduler)
    step(scheduler, recving={CHILDREN[0]})
    out = scheduler.schedule()
    imports = out.aux_output_connector_metadata.rows_imports
    leader = tuple(block_ids(scheduler, CHILDREN[0]))
    # The leader imports the 70 positions its pull brought; each sibling the 69
    # it adopted, from the leader's blocks (its own block 4 is a copy still to
    # be made), and computes the row of position 69 itself.
    assert (imports[CHILDREN[0]].start, imports[CHILDREN[0]].end) == (0, 70)
    assert imports[CHILDREN[0]].block_ids == leader
    for rid in CHILDREN[1:]:
        assert (imports[rid].start, imports[rid].end) == (0, 69)
        assert imports[rid].block_ids == leader
        assert block_ids(scheduler, rid)[4] not in leader


def test_where_blocks_cannot_be_adopted_siblings_compute_at_once() -> None:
    # No prefix cache, or a KV cache group that is not full attention: a
    # sibling never waits for the load nor reads the hand-off again.
    loads = SharedLoads(lease_seconds=30, adopt=False)
    for rid in CHILDREN:
        loads.add(rid, KEY, PROMPT)
    assert loads.state(CHILDREN[1]) == SharedLoadState.LOAD  # nobody pulls yet
    loads.started(CHILDREN[0], load_kv_async=True)
    assert loads.state(CHILDREN[1]) == SharedLoadState.CONSUMED
    blocks = ([KVCacheBlock(block_id=3)],)
    assert not loads.land(CHILDREN[0], blocks, 16, False, now=100.0)
    assert loads.num_pins() == 0


def test_another_prompt_with_the_same_handoff_computes_its_own(
    model_dir: Path,
) -> None:
    """A request that carries the group's hand-off with another prompt (a client
    or router that copied another request's kv_transfer_params) never pulls,
    waits for or adopts that KV: it computes its whole prompt locally at once.
    The siblings with the group's prompt still adopt the pull (the control)."""
    scheduler = decode_scheduler(model_dir)
    add_group(scheduler, 70)
    other = [(7 * i) % 300 + 11 for i in range(70)]
    scheduler.add_request(make_request("other", other, kv_transfer_params=handoff(5)))
    first = run(scheduler)
    assert pulls(first) == {CHILDREN[0]}
    assert first.num_scheduled_tokens["other"] == 70
    assert not scheduler.requests["other"].kv_transfer_params["do_remote_prefill"]
    run(scheduler, recving={CHILDREN[0]})
    adopting = run(scheduler)
    assert pulls(adopting) == set()
    leader = block_ids(scheduler, CHILDREN[0])
    for rid in CHILDREN[1:]:
        assert block_ids(scheduler, rid)[:4] == leader[:4]
        assert adopting.num_scheduled_tokens[rid] == 1
    assert not set(block_ids(scheduler, "other")) & set(leader)
    while scheduler.requests:
        assert "other" not in pulls(run(scheduler))
    assert scheduler.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize(
    "prompt",
    [
        HandoffPrompt(tuple(range(3, 34)) + (99,), PROMPT.block_hashes),
        # The same tokens with other multimodal inputs, LoRA or cache salt: the
        # block hashes chain those in.
        HandoffPrompt(PROMPT.token_ids, (b"block-0", b"block-1-other-image")),
    ],
    ids=["other-tokens", "other-block-hashes"],
)
def test_only_requests_with_the_same_prompt_are_members(prompt: HandoffPrompt) -> None:
    loads = SharedLoads(lease_seconds=30)
    loads.add(CHILDREN[0], KEY, PROMPT)
    loads.add(CHILDREN[1], KEY, HandoffPrompt(PROMPT.token_ids, PROMPT.block_hashes))
    loads.add("other", KEY, prompt)
    assert loads.state("other") == SharedLoadState.CONSUMED  # before any load
    loads.started(CHILDREN[0], load_kv_async=True)
    assert loads.state(CHILDREN[1]) == SharedLoadState.WAIT
    assert loads.state("other") == SharedLoadState.CONSUMED
    blocks = ([KVCacheBlock(block_id=3), KVCacheBlock(block_id=4)],)
    assert loads.land(CHILDREN[0], blocks, 32, False, now=100.0)
    assert loads.state("other") == SharedLoadState.CONSUMED  # never ADOPT
    # It never notifies prefill (the group's members read the hand-off), and
    # the pin waits for the real sibling only.
    assert loads.finished("other") == (None, True)
    assert loads.num_pins() == 1
    assert loads.adopted(CHILDREN[1]) is not None


def test_a_prompt_given_as_embeddings_shares_nothing() -> None:
    embeds = HandoffPrompt(None, ())
    loads = SharedLoads(lease_seconds=30)
    loads.add(CHILDREN[0], KEY, embeds)
    loads.add(CHILDREN[1], KEY, embeds)
    loads.started(CHILDREN[0], load_kv_async=True)
    assert loads.state(CHILDREN[1]) == SharedLoadState.CONSUMED
