"""Lease generations through a real Scheduler with a NixlConnector producer.

A prefill instance's hand-off carries the generations of its blocks
(``remote_block_generations``); when a worker reports the lease expired, the
scheduler frees the blocks and the next step's connector metadata carries the
bumps, so the workers write them before that step can reuse a block. A normal
finish bumps nothing. Values are hand-derived: generations start at 0 and go up
by one per expiry of a lease that held the block.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.v1.core.nixl_lease_scheduler_utils import finish_sending, hand_off, producer

pytestmark = pytest.mark.usefixtures("scheduler_env")


def test_expired_lease_bumps_its_blocks_for_the_workers(model_dir: Path) -> None:
    scheduler = producer(model_dir)
    blocks, generations = hand_off(scheduler, "a")
    assert len(blocks) == 1 and len(blocks[0]) == 3
    assert generations == [[0, 0, 0]]
    updates = finish_sending(scheduler, "a", expired=True)
    assert updates == {b: 1 for b in blocks[0]}
    # Sent once: the step after carries nothing.
    assert scheduler.schedule().kv_connector_metadata.block_generation_updates == {}
    # The same prompt again hits the freed (cached) blocks: its hand-off carries
    # the generation the workers now hold.
    again, generations = hand_off(scheduler, "b")
    assert again[0][:2] == blocks[0][:2]
    assert generations[0][:2] == [1, 1]
    assert finish_sending(scheduler, "b", expired=True) == {
        b: (2 if b in blocks[0] else 1) for b in again[0]
    }


def test_normal_finish_bumps_nothing(model_dir: Path) -> None:
    """Negative control: the same lifecycle without the expiry report."""
    scheduler = producer(model_dir)
    blocks, _ = hand_off(scheduler, "a")
    assert finish_sending(scheduler, "a", expired=False) == {}
    _, generations = hand_off(scheduler, "b")
    assert generations == [[0, 0, 0]]
