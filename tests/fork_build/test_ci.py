"""make test's phases as data (`python -m tools.fork ci`, tools/forkbuild/ci.py).

The plan is checked against what this checkout holds (its bases, the demo's entry
point); the runner runs tiny `python -c` steps, each failure kind with a step that
must fail."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tools.forkbuild import ci
from tools.forkbuild.build import base_releases

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def _names(stages: list[ci.Stage]) -> list[list[list[str]]]:
    return [[[s.name for s in lane.steps] for lane in stage.lanes] for stage in stages]


def _step(name: str, code: str, expect: str | None = None) -> ci.Step:
    return ci.Step(name, (PY, "-c", code), expect=expect)


def test_the_plan_runs_the_demo_the_suite_and_every_base() -> None:
    stages = ci.plan(ROOT, PY)
    steps = [s for stage in stages for lane in stage.lanes for s in lane.steps]
    argvs = {s.name: s.argv for s in steps}
    # The README's main command, with the line it must print.
    demo = next(s for s in steps if s.argv[1:] == ("-m", "tools.demo"))
    assert demo.expect == ci.DEMO_VERDICT
    assert re.search(demo.expect, "x\nP/D rows (rows-over-nixl) equal colocated rows: True; "
                     "tokens equal: True\n", re.M)
    for verdict in ("False; tokens equal: True", "True; tokens equal: False"):
        assert not re.search(demo.expect,
                             f"P/D rows (rows-over-nixl) equal colocated rows: {verdict}\n",
                             re.M)
    # The merge mode is an option; make test runs the recommended path.
    assert not re.search(demo.expect, "P/D rows (proxy-merge) equal colocated rows: True; "
                         "tokens equal: True\n", re.M)
    # The suite in two parts that together select what NOT_IN_MAKE_TEST leaves: what
    # make e2e's pytest run selects (tools/e2e/plan.py), and only that.
    assert ci.NOT_IN_MAKE_TEST == (
        "not e2e_control and not e2e_store and not e2e_full and not pr_stack")
    unit, served = argvs["pytest over tests/: unit"], argvs["pytest over tests/: served"]
    assert unit[:4] == served[:4] == (PY, "-m", "pytest", "tests")
    assert unit[5] == f"not e2e and {ci.NOT_IN_MAKE_TEST}"
    assert served[5] == f"e2e and {ci.NOT_IN_MAKE_TEST}"
    assert "lint, every base" in argvs
    # The newest base has its upstream fast set (make upstream-tests runs every
    # base's); every carried one its unit tests and check-prs.
    carried = base_releases(ROOT)[1:]
    assert carried, "bases/ holds at least one carried release"
    assert [name for name in argvs if name.endswith("upstream's fast set")] == [
        f"{carried[-1]}: upstream's fast set"]
    for release in carried:
        for phase in ("the series' unit tests", "check-prs"):
            assert f"{release}: {phase}" in argvs, (release, phase)
        assert argvs[f"{release}: the series' unit tests"][0] == str(
            ROOT / f".venv-{release}" / "bin" / "python")


def test_no_stage_runs_more_than_two_lanes_side_by_side() -> None:
    # CI has two cores; each lane is one single-process job.
    assert all(len(stage.lanes) <= 2 for stage in ci.plan(ROOT, PY))


def test_two_stages_and_one_fast_set_beside_single_process_lanes() -> None:
    # Written out by hand from the plan's docstring, for this checkout's bases.
    primary, *carried = base_releases(ROOT)
    newest = carried[-1]  # bases/ carries releases newer than the primary

    def venv(release: str) -> str:
        kind = "serving stand-in" if release in ci.SERVING_STANDINS else "stand-in"
        return f"{release}: venv ({kind})"

    units = ["pytest over tests/: unit", "lint, every base", "demo (make demo)"]
    checks = []
    for release in carried:
        units += [venv(release), f"{release}: the series' unit tests"]
        checks += [f"{release}: check-prs"]
        if release in ci.SERVING_STANDINS:
            checks += [f"{release}: served tests"]
    expected = [
        [["pytest over tests/: served"], units],
        [[f"{newest}: upstream's fast set"], checks],
    ]
    assert _names(ci.plan(ROOT, PY)) == expected
    fast_set = ci.plan(ROOT, PY)[1].lanes[0].steps[0]
    assert fast_set.argv == (PY, "-m", "tools.fork", "upstream-tests",
                             "--base-release", newest)


def test_only_keeps_matching_steps_in_their_stages() -> None:
    stages = ci.select(ci.plan(ROOT, PY), ["*upstream*"])
    names = _names(stages)
    flat = [n for stage in names for lane in stage for n in lane]
    assert flat and all("upstream" in n for n in flat), names
    assert ci.select(ci.plan(ROOT, PY), ["no such phase"]) == []


def test_pytest_args_reach_every_pytest_phase() -> None:
    stages = ci.plan(ROOT, PY, ("-x", "-k", "foo"))
    pytests = [s for stage in stages for lane in stage.lanes for s in lane.steps
               if "pytest" in s.argv]
    assert len(pytests) >= 2
    assert all(s.argv[-3:] == ("-x", "-k", "foo") for s in pytests)


def test_a_passing_run(capsys: pytest.CaptureFixture[str]) -> None:
    results = ci.run([ci.serial(_step("one", "print('hello')", expect="^hello$")),
                      ci.beside([_step("two", "print(2)")], [_step("three", "print(3)")])],
                     ROOT)
    assert [(r.step.name, r.code, r.passed) for r in results] == [
        ("one", 0, True), ("two", 0, True), ("three", 0, True)]
    assert ci.summary(results).splitlines()[-1] == "ci: 3 passed, 0 failed"
    out = capsys.readouterr().out
    assert "hello" in out and re.search(r"^-- one: ok in \d+ s$", out, re.M)


def test_a_failed_exit_stops_later_stages_but_not_its_stage() -> None:
    results = ci.run([
        ci.beside([_step("fails", "raise SystemExit(3)"), _step("after", "pass")],
                  [_step("beside", "pass")]),
        ci.serial(_step("later", "pass")),
    ], ROOT)
    by_name = {r.step.name: r for r in results}
    assert by_name["fails"].code == 3 and by_name["fails"].problem == "exit 3"
    assert by_name["after"].code is None  # its lane ended
    assert by_name["beside"].passed  # the other lane finished
    assert by_name["later"].code is None  # no later stage started
    assert ci.summary(results).splitlines()[-1] == "ci: 1 passed, 1 failed"


def test_a_missing_verdict_line_fails_the_step() -> None:
    # Exit 0, but the demo's verdict says the rows differ: that must fail.
    results = ci.run([ci.serial(_step(
        "demo", "print('P/D rows (rows-over-nixl) equal colocated rows: False; tokens equal: True')",
        expect=ci.DEMO_VERDICT))], ROOT)
    assert results[0].code == 0 and not results[0].passed
    assert "lacks a line matching" in results[0].problem


def test_an_unknown_phase_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert ci.main(ROOT, PY, ["nothing-like-this"], "", list_only=True) == 2
    assert "python -m tools.fork ci --list" in capsys.readouterr().err
