"""benchmarks/measure.py, the measuring core: the order of the rounds, the spread of
per-round values, per-round ratios, timed spans and the result record, against values
worked out by hand."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from benchmarks.cpu_meter import CpuMeter, CpuUse
from benchmarks.measure import (
    Result,
    Spent,
    Spread,
    order,
    ratios,
    run_rounds,
    spend,
    spread,
    timed,
)


def test_two_variants_alternate_over_four_rounds() -> None:
    assert [order(["a", "b"], i) for i in range(4)] == [
        ["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]


def test_three_variants_mirror_over_four_rounds() -> None:
    """A B C, C B A: each variant's mean position over a pair of rounds is 1."""
    assert [order(("a", "b", "c"), i) for i in range(4)] == [
        ["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]
    positions = {v: sum(order("abc", i).index(v) for i in range(4)) for v in "abc"}
    assert positions == {"a": 4, "b": 4, "c": 4}


def test_rounds_run_warm_ups_first_and_keep_only_the_counted_ones() -> None:
    calls: list[tuple[str, int]] = []

    def run(variant: str, round_index: int) -> str:
        calls.append((variant, round_index))
        return f"{variant}{round_index}"

    kept = run_rounds(["on", "off"], 3, run, warmup=1)
    # Warm-up round -1 is odd: reversed.
    assert calls == [("off", -1), ("on", -1), ("on", 0), ("off", 0),
                     ("off", 1), ("on", 1), ("on", 2), ("off", 2)]
    assert kept == {"on": ["on0", "on1", "on2"], "off": ["off0", "off1", "off2"]}


def test_the_spread_of_a_hand_made_list() -> None:
    # Sorted 2, 3, 4, 5, 10: median 4, spread (10 - 2) / 4 = 2.
    s = spread([4.0, 10.0, 2.0, 5.0, 3.0])
    assert s == Spread(median=4.0, low=2.0, high=10.0, count=5)
    assert s.relative == 2.0
    assert s.format(".2f") == "4.00 (200.0%)"
    # Even count: the median is the mean of the middle two, (3 + 5) / 2.
    assert spread([1.0, 3.0, 5.0, 7.0]).median == 4.0
    assert spread([0.0, 0.0]).relative == 0.0
    with pytest.raises(ValueError):
        spread([])


def test_ratios_pair_the_rounds() -> None:
    # 6/4 = 1.5, 8/8 = 1.0, 9/3 = 3.0: median 1.5 (a ratio of medians, 8/4, would be 2).
    r = ratios([6.0, 8.0, 9.0], [4.0, 8.0, 3.0])
    assert (r.median, r.low, r.high, r.count) == (1.5, 1.0, 3.0, 3)
    with pytest.raises(ValueError, match="not paired"):
        ratios([1.0, 2.0], [1.0])


def test_timed_reads_the_clock_it_is_given() -> None:
    ticks = iter([10.0, 12.5])
    seconds, value = timed(lambda: "done", clock=lambda: next(ticks))
    assert (seconds, value) == (2.5, "done")
    seconds, _ = timed(lambda: time.sleep(0.05))
    assert 0.05 <= seconds < 1.0


def test_spend_counts_this_process_and_the_meter() -> None:
    def busy() -> int:
        end = time.process_time() + 0.2
        while time.process_time() < end:
            pass
        return 7

    spent, value = spend(busy, CpuMeter({"me": os.getpid()}))
    assert value == 7
    assert spent.own_cpu >= 0.2 and spent.wall >= 0.2
    assert spent.cpu is not None and spent.cpu.by_role["me"] >= 0.15
    unmetered, _ = spend(lambda: None)
    assert unmetered.cpu is None


def test_spans_add_up() -> None:
    one = Spent(CpuUse({"a": 1.0}, {}), 0.5, 2.0)
    two = Spent(CpuUse({"a": 2.0}, {}), 0.25, 3.0)
    both = one + two
    assert (both.cpu.by_role if both.cpu else None, both.own_cpu, both.wall) == (
        {"a": 3.0}, 0.75, 5.0)
    assert (one + Spent(None, 0.0, 1.0)).cpu is None


def test_the_result_record_reads_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    result = Result("benchmarks.example", {"rounds": 3, "workdir": Path("/tmp/x")},
                    {"on": spread([1.0, 2.0, 3.0])}, {"on / off": 1.25})
    path = tmp_path / "result.json"
    result.emit(str(path))
    assert json.loads(path.read_text()) == {
        "benchmark": "benchmarks.example", "setup": {"rounds": 3, "workdir": "/tmp/x"},
        "figures": {"on": {"median": 2.0, "low": 1.0, "high": 3.0, "count": 3}},
        "ratios": {"on / off": 1.25}}
    result.emit("-")
    assert json.loads(capsys.readouterr().out)["ratios"] == {"on / off": 1.25}
    result.emit(None)
    assert capsys.readouterr().out == ""
