"""The soak's workload plan and verdict (tools/e2e/soak.py), without servers.

The plan must cover what the soak's workload is meant to hold (prompt lengths 1-512,
completions 1-32, every kind of start, multi-turn reuse, client aborts) and be the
same for the same seed; the verdict must fail a run with a mismatch, an unclear
failure, a leak or too few completions, and pass a clean one (the control).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_r3_pdproxy.merge import encode_npy
from tools.e2e import soak
from tools.e2e.scenarios import BLOCK_SIZE
from tools.e2e.compare import compare_group
from tools.e2e.soak import (
    MAX_COMPLETION,
    MAX_PROMPT,
    Tally,
    Turn,
    body,
    classify,
    clear_error,
    plan,
    plan_conversation,
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


# RL groups (--group-size): the plan mixes them in without changing the single
# requests; a group is compared with the reference choice by choice by index.


def test_groups_leave_the_single_requests_as_they_were() -> None:
    assert plan(0, 500, group_size=0) == plan(0, 500)  # 0: the plan before groups
    conversations = plan(0, 500, group_size=4)
    turns = [turn for conversation in conversations for turn in conversation]
    assert len(turns) == 500
    assert plan(0, 500, group_size=4) == conversations  # seeded
    groups = [c for c in conversations if c[0].n > 1]
    # A group is one request, as the same conversation's first turn with n and
    # seeded non-greedy sampling; every other conversation is exactly as before.
    for index, conversation in enumerate(conversations):
        first = plan_conversation(0, index)[0]
        if conversation[0].n > 1:
            (group,) = conversation
            assert group.n == 4
            assert replace(group, n=1, sampling=()) == first
            sampling = dict(group.sampling)
            assert sampling.keys() == {"temperature", "top_p", "top_k", "seed"}
            assert sampling["temperature"] > 0
        else:
            assert all(t.n == 1 and t.sampling == () for t in conversation)
            assert conversation == plan_conversation(0, index)[: len(conversation)]
    # About GROUP_SHARE of the conversations (330 here): 60 groups, 50 not aborted,
    # some aborted each way; both a top-k and a top-p other than off among them.
    assert 0.10 * len(conversations) < len(groups) < 0.20 * len(conversations)
    aborts = Counter(c[0].abort for c in groups)
    assert aborts[None] > 30 and aborts["stream"] and aborts["timeout"]
    assert {dict(c[0].sampling)["top_k"] for c in groups} >= {-1, 5, 20}
    assert {dict(c[0].sampling)["top_p"] for c in groups} >= {1.0, 0.8}


def test_the_reduced_soak_holds_one_group_that_completes() -> None:
    """tests/v1/kv_connector/test_soak_e2e.py counts on it: seed 0, 16 requests."""
    groups = [t for c in plan(0, 16, group_size=4) for t in c if t.n > 1]
    assert [(t.extra_prompt, t.max_tokens, t.start, t.abort, t.n) for t in groups] == [
        (216, 32, 0, None, 4)
    ]


def test_a_group_body_samples_with_its_seed_and_a_single_one_is_greedy() -> None:
    group = Turn(5, 3, 0, n=4, sampling=(("temperature", 0.8), ("top_p", 0.95),
                                         ("top_k", 5), ("seed", 11)))
    got = body([1, 2, 3, 4, 5], group, 2)
    assert {k: got[k] for k in ("n", "temperature", "top_p", "top_k", "seed")} == {
        "n": 4, "temperature": 0.8, "top_p": 0.95, "top_k": 5, "seed": 11}
    assert got["routed_experts_prompt_start"] == 2 and got["max_tokens"] == 3
    single = body([1, 2, 3, 4, 5], Turn(5, 3, 0), 0)
    assert single["temperature"] == 0 and "n" not in single and "seed" not in single


def group_response(order: tuple[int, ...] = (0, 1, 2), shift: dict[int, int] | None = None,
                   tokens: dict[int, list[int]] | None = None) -> dict:
    """A /v1/completions answer to a 4-token prompt with n = 3, 3 tokens per choice,
    rows from 0: 4 + 3 - 1 = 6 rows each. Choice i's tokens are [10i, 10i+1, 10i+2]
    and its rows hold 2i + position (+ shift[i]), so no two choices are alike."""
    shift, tokens = shift or {}, tokens or {}
    choices = []
    for i in order:
        rows = (np.arange(6, dtype=np.uint8) + 2 * i + shift.get(i, 0))[:, None, None]
        choices.append({
            "index": i,
            "token_ids": tokens.get(i, [10 * i, 10 * i + 1, 10 * i + 2]),
            "prompt_token_ids": [1, 2, 3, 4],
            "routed_experts": encode_npy(np.broadcast_to(rows, (6, 2, 2)).copy()),
            "routed_experts_start": 0,
        })
    return {"choices": choices}


def test_a_group_is_compared_choice_by_choice_by_index_not_order() -> None:
    ref = group_response()
    assert compare_group(group_response(), ref, 3).problem is None
    # The same choices in another order (a stream's finishing order): equal.
    assert compare_group(group_response(order=(2, 0, 1)), ref, 3).problem is None
    # Choice 1's rows one position off (each row holds the next position's experts):
    # the group differs, at every one of choice 1's positions, and choices 0 and 2 are
    # not blamed.
    outcome = compare_group(group_response(shift={1: 1}), ref, 3)
    assert outcome.problem is not None and not outcome.rows_equal
    assert outcome.tokens_equal
    assert outcome.problem.startswith("choice 1: rows differ")
    assert "6 of 6 positions differ, at [0, 1, 2, 3, 4, 5]" in outcome.problem
    assert "choice 0" not in outcome.problem and "choice 2" not in outcome.problem
    # Choice 2's tokens alone differ.
    outcome = compare_group(group_response(tokens={2: [20, 21, 99]}), ref, 3)
    assert outcome.problem == "choice 2: token ids differ: P/D [20, 21, 99] vs [20, 21, 22]"
    assert outcome.rows_equal and not outcome.tokens_equal


def test_a_group_with_choices_swapped_missing_or_twice_differs() -> None:
    ref = group_response()
    # Choices 0 and 1 answered under each other's index: compared by index, both differ
    # (compared by order they would pass once sorted by content).
    swapped = group_response(order=(1, 0, 2))
    swapped["choices"][0]["index"], swapped["choices"][1]["index"] = 0, 1
    outcome = compare_group(swapped, ref, 3)
    assert outcome.problem is not None
    assert outcome.problem.count("choice 0: ") == 1 and "choice 1: " in outcome.problem
    assert "choice 2" not in outcome.problem
    missing = compare_group(group_response(order=(0, 2)), ref, 3)
    assert missing.problem == "P/D choices have indices [0, 2], expected 0..2 once each"
    twice = compare_group(group_response(order=(0, 1, 1, 2)), ref, 3)
    assert twice.problem == ("P/D choices have indices [0, 1, 1, 2], expected 0..2 "
                             "once each")
    # A reference that answered fewer choices than asked for is no pass either.
    short = compare_group(group_response(), group_response(order=(0, 1)), 3)
    assert short.problem == "colocated choices have indices [0, 1], expected 0..2 once each"


def test_the_verdict_counts_a_group_once_and_its_abort_as_an_abort() -> None:
    ref = group_response()
    tally = Tally()
    classify(tally, "g1", group_response(order=(1, 2, 0)), ref, n=3)
    classify(tally, "g2", group_response(shift={2: 1}), ref, n=3)  # one choice off
    classify(tally, "g3", {"error": 'HTTP 502: {"error": "decode died"}'}, ref, n=3)
    classify(tally, "s", response(0, [7, 8]), response(0, [7, 8]))
    assert (tally.sent, tally.groups, tally.equal, tally.groups_equal) == (4, 3, 2, 1)
    assert tally.failed_clearly == 1
    assert len(tally.mismatches) == 1 and tally.mismatches[0].startswith("g2: choice 2: ")
    assert report(tally, {}, {}, {}, {}, [], 1.0) == 1


@pytest.mark.parametrize(
    ("argv", "group_size", "error"),
    [
        ([], 4, None),  # the default mixes groups of 4 in
        (["--group-size", "0"], 0, None),  # single requests only
        (["--group-size", "16", "--mode", "proxy-merge"], 16, None),  # both modes
        (["--group-size", "1"], None, "argument --group-size: must be 0"),
        (["--group-size", "-2"], None, "argument --group-size: must be 0"),
    ],
)
def test_the_group_size_flag(monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str], argv: list[str],
                             group_size: int | None, error: str | None) -> None:
    parsed = []
    monkeypatch.setattr(soak, "soak", lambda args: parsed.append(args) or 0)
    monkeypatch.setattr(soak, "unwind_on_sigterm", lambda: None)
    if error is None:
        assert soak.main(argv) == 0
        assert parsed[0].group_size == group_size
    else:
        with pytest.raises(SystemExit) as exited:
            soak.main(argv)
        assert exited.value.code == 2 and error in capsys.readouterr().err
