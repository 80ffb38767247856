"""The soak's workload plan and verdict (tools/e2e/soak.py), without servers.

The plan must cover what the soak's workload is meant to hold (prompt lengths 1-512,
completions 1-32, every kind of start, multi-turn reuse, client aborts) and be the
same for the same seed; the verdict must fail a run with a mismatch, an unclear
failure, a leak or too few completions, and pass a clean one (the control).
"""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_r3_pdproxy.merge import encode_npy
from tools.e2e import soak
from tools.e2e.scenarios import BLOCK_SIZE
from tools.e2e.soak import (
    MAX_COMPLETION,
    MAX_PROMPT,
    Tally,
    classify,
    clear_error,
    plan,
    report,
    soak_deployment,
)


def test_the_plan_covers_the_workload_and_is_seeded() -> None:
    conversations = plan(0, 500)
    turns = [turn for conversation in conversations for turn in conversation]
    assert len(turns) == 500
    assert plan(0, 500) == conversations and plan(1, 500) != conversations
    lengths = []
    for conversation in conversations:
        total = 0
        for turn in conversation:
            total += turn.extra_prompt
            lengths.append(total)
            total += turn.max_tokens
    assert min(lengths) >= 1 and max(lengths) <= MAX_PROMPT
    assert max(lengths) > 480 and sum(n < 32 for n in lengths) > 10  # both ends reached
    assert {t.max_tokens for t in turns} == set(range(1, MAX_COMPLETION + 1))
    starts = Counter(
        "prev" if t.start == "prev" else "zero" if t.start == 0 else "other"
        for t in turns
    )
    assert starts["prev"] > 10 and starts["zero"] > 50 and starts["other"] > 100
    assert any(
        t.start != "prev" and t.start % BLOCK_SIZE == 0 and t.start for t in turns
    )
    assert sum(len(c) > 1 for c in conversations) > 50  # multi-turn reuse
    aborts = Counter(t.abort for t in turns)
    assert aborts["stream"] > 10 and aborts["timeout"] > 10 and aborts[None] > 400


def response(rows_start: int, tokens: list[int], shift: int = 0) -> dict:
    rows = np.arange(rows_start, rows_start + 6, dtype=np.uint8)[:, None, None]
    rows = np.broadcast_to(rows + shift, (6, 2, 2)).copy()
    return {
        "choices": [
            {
                "token_ids": tokens,
                "routed_experts": encode_npy(rows),
                "routed_experts_start": rows_start,
            }
        ]
    }


@pytest.mark.parametrize(
    ("error", "clear"),
    [
        ('HTTP 502: {"error": {"message": "backend unreachable: ..."}}', True),
        ("HTTP 500: ", False),
        ("URLError: <urlopen error [Errno 111] Connection refused>", True),
        ("TimeoutError: timed out", False),  # no answer at all is not an answer
    ],
)
def test_a_clear_error_has_a_status_and_a_message(error: str, clear: bool) -> None:
    assert clear_error(error) is clear


def test_the_verdict() -> None:
    good, ref = response(0, [7, 8]), response(0, [7, 8])
    clean = Tally()
    for _ in range(3):
        classify(clean, "r", good, ref)
    classify(clean, "r", {"error": 'HTTP 502: {"error": "decode died"}'}, ref)
    assert (clean.sent, clean.equal, clean.failed_clearly) == (4, 3, 1)
    assert report(clean, {}, {"decode": 0}, {"decode": 0}, {}, [], 1.0) == 0

    shifted = Tally()
    classify(shifted, "r", response(0, [7, 8], shift=1), ref)  # rows one expert off
    classify(shifted, "r", good, ref)
    assert len(shifted.mismatches) == 1
    assert report(shifted, {}, {}, {}, {}, [], 1.0) == 1

    leaked = Tally()
    classify(leaked, "r", good, ref)
    assert report(leaked, {"decode floors": 2.0}, {}, {}, {}, [], 1.0) == 1

    unclear = Tally()
    classify(unclear, "r", good, ref)
    classify(unclear, "r", {"error": "TimeoutError: timed out"}, ref)
    assert report(unclear, {}, {}, {}, {}, [], 1.0) == 1

    starved = Tally()
    classify(starved, "r", good, ref)
    for _ in range(2):
        classify(starved, "r", {"error": "HTTP 502: decode died"}, ref)
    assert report(starved, {}, {}, {}, {}, [], 1.0) == 1  # 1 of 3 completed


def test_a_fault_that_went_wrong_fails_the_verdict() -> None:
    tally = Tally()
    classify(tally, "r", response(0, [7, 8]), response(0, [7, 8]))
    assert report(tally, {}, {}, {}, {}, [], 1.0, problems=[]) == 0
    assert report(tally, {}, {}, {}, {}, [], 1.0, problems=["store down"]) == 1


def test_the_store_is_deployed_only_for_its_master_restart() -> None:
    assert soak_deployment(["decode-kill"]).offload is None
    store = soak_deployment(["decode-kill", "mooncake-restart"])
    assert (store.offload.kind, store.offload.num_bytes) == ("mooncake", 256 << 20)
    assert (store.decode_offload.kind, store.decode_offload.num_bytes) == (
        "mooncake",
        0,
    )


class _Master:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def stop(self) -> None:
        self.calls.append("stop")

    def start(self) -> None:
        self.calls.append("start")


class _Process:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> None:
        return None


def _cluster(pids: dict[str, int]) -> SimpleNamespace:
    servers = {
        name: SimpleNamespace(url=f"http://{name}", process=_Process(pid))
        for name, pid in pids.items()
    }
    return SimpleNamespace(master=_Master(), servers=servers)


@pytest.mark.parametrize(
    ("loads", "swap_decode", "problem"),
    [
        ([96.0, 96.0, 96.0, 192.0], False, None),  # loads again after two polls
        ([96.0] * 3, False, "served no load"),  # the control: it never does
        ([96.0, 192.0], True, "lost its process"),  # decode died meanwhile
    ],
)
def test_the_master_restart_checks_recovery_and_processes(
    monkeypatch: pytest.MonkeyPatch, loads: list[float], swap_decode: bool, problem
) -> None:
    cluster = _cluster({"prefill": 10, "decode": 20})
    readings = iter(loads)
    done = threading.Event()

    def counter(url: str, name: str) -> float:
        assert (url, name) == ("http://prefill", soak.EXTERNAL_HITS)
        try:
            return next(readings)
        except StopIteration:  # the workload ended while the store stayed dry
            done.set()
            return loads[-1]

    def restarted_master_start() -> None:
        cluster.master.calls.append("start")
        if swap_decode:
            cluster.servers["decode"].process = _Process(21)

    monkeypatch.setattr(soak, "read_total", counter)
    monkeypatch.setattr(soak.time, "sleep", lambda seconds: None)
    cluster.master.start = restarted_master_start
    events: list[str] = []
    problems: list[str] = []
    carried = {"prefill": {}, "decode": {}}
    soak.restart_store(cluster, Tally(), events, carried, problems, done)
    assert cluster.master.calls == ["stop", "start"]
    assert len(events) == 1 and events[0].startswith("mooncake master restarted")
    if problem is None:
        assert problems == [], problems
        assert "loaded from the store again" in events[0]
    else:
        assert len(problems) == 1 and problem in problems[0], problems


class _Clock:
    """time.monotonic and time.sleep for code that polls: sleeping moves the clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        # Prefill holds two hand-offs; decode reads one, the other's lease runs out.
        ([2.0, 1.0, 0.0], {}),
        # The control: a lease that is never released is reported after one lease.
        ([1.0], {"prefill vllm:kv_transfer_held_requests (KV held for a transfer)": 1}),
    ],
)
def test_the_leak_check_waits_one_lease_for_held_kv(
    monkeypatch: pytest.MonkeyPatch, held: list[float], expected: dict[str, float]
) -> None:
    cluster = _cluster({"prefill": 10, "decode": 20})
    clock = _Clock()
    readings = iter(held)
    last = held[-1]

    def counter(url: str, name: str) -> float:
        nonlocal last
        if (url, name) == ("http://prefill", soak.KV_HELD):
            last = next(readings, last)
            return last
        return 0.0  # busy and leak gauges, KV usage, decode's held KV

    monkeypatch.setattr(soak, "read_total", counter)
    monkeypatch.setattr(soak, "time", SimpleNamespace(
        monotonic=clock.monotonic, sleep=clock.sleep))
    assert soak.leaked_state(cluster, lease_seconds=60) == expected
    # It waited for the lease (60 s and 30 s more) only when something stayed held.
    assert (clock.now > 60) == bool(expected)
