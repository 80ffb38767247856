"""benchmarks/pd_rows_latency.py without servers: its modes carry the glossary's names
(rows over NIXL, the proxy merge), `--splice-first` still works as a deprecated alias
of `--proxy-merge-first`, and the table divides each rows-over-nixl front end by the
proxy merge."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.pd_rows_latency import MODES, check_equal, parse_args, print_table


def test_the_modes_are_named_as_the_glossary_names_them() -> None:
    assert MODES == ("proxy-merge", "rows-over-nixl (pdproxy)",
                     "rows-over-nixl (vllm-router)")


def test_the_old_order_flag_still_works_and_warns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_args([]).proxy_merge_first is False
    preferred = parse_args(["--proxy-merge-first"])
    assert preferred.proxy_merge_first is True
    assert capsys.readouterr().err == ""
    assert parse_args(["--splice-first"]) == preferred
    assert capsys.readouterr().err == ("python -m benchmarks.pd_rows_latency: "
                                       "--splice-first is deprecated; use "
                                       "--proxy-merge-first\n")


def test_the_table_divides_each_front_end_by_the_proxy_merge(
    capsys: pytest.CaptureFixture[str],
) -> None:
    times = {("proxy-merge", 64): [2.0, 4.0], ("rows-over-nixl (pdproxy)", 64): [1.0, 3.0],
             ("rows-over-nixl (vllm-router)", 64): [3.0, 5.0]}
    print_table(list(MODES), [64], times, rounds=2)
    lines = capsys.readouterr().out.splitlines()
    starts = {line.split()[0]: index for index, line in enumerate(lines)}
    median, fastest = lines[starts["median"] + 2], lines[starts["fastest"] + 2]
    assert median.split() == ["64", "3.000", "2.000", "4.000", "0.667", "1.333"]
    assert fastest.split() == ["64", "2.000", "1.000", "3.000", "0.500", "1.500"]
    header = lines[1]
    assert "rows-over-nixl (vllm-router) / proxy-merge" in header


def test_a_mode_whose_rows_differ_from_the_proxy_merge_stops_the_run() -> None:
    rows = np.zeros((3, 2, 2), np.uint8)
    results = {("proxy-merge", 1, 64): ([1, 2], rows),
               ("rows-over-nixl (pdproxy)", 1, 64): ([1, 2], rows.copy())}
    check_equal(results)
    results[("rows-over-nixl (vllm-router)", 1, 64)] = ([1, 2], rows + 1)
    with pytest.raises(RuntimeError, match="vllm-router.*differ from the proxy-merge"):
        check_equal(results)
