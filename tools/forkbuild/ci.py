"""`make test` as data: the phases of the fork's test run, and a runner for them.

A `Step` is one command. Steps of one `Lane` run one after another; the lanes of
one `Stage` run side by side (each is one single-process job, so two fit on the
2 cores CI has); stages run in order. The plan (`plan()`) is two stages; the
served tests, which start several servers per test, run beside single-process
jobs only, and upstream's fast set, which takes both cores (`upstream-tests
--jobs`), runs beside one single-process lane:

1. the served tests (pytest over `tests/`, marker `e2e`, without the markers that
   `make e2e` runs); beside them the unit tests, vLLM's ruff over every file the PRs
   add or change on every base, the demo (`python -m tools.demo`, what `make demo`
   runs, its printed verdict asserted), then each carried base's venv and the
   series' unit tests there;
2. upstream's fast set on the newest base (the one upstream PRs target); beside it,
   per carried base, its `check-prs` and (for a base with a serving stand-in) the
   served tests on it. Every base's fast set: `make upstream-tests` (each base's
   own pinned sources; the patches make the same change on every base, apart from
   the differences `check-bases` records).

Failure policy: a step fails on a non-zero exit or when its output lacks the line
it must print (`expect`); a failed step ends its lane, the stage still finishes its
other lanes, and no later stage starts. Every step prints its start time and its
duration; the run ends with a table of them and the line `ci: N passed, N failed`.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools.e2e.plan import MAKE_E2E_MARKERS  # standard library only

from .build import base_releases, newest_release
from .pins import load_pins
from .standin import standin_env

# The markers `make e2e` runs instead (tools/e2e/plan.py lists them; pyproject.toml
# says what each means).
NOT_IN_MAKE_TEST = " and ".join(f"not {marker}" for marker in MAKE_E2E_MARKERS)
# The series' unit tests that run on every carried base's stand-in.
BASE_UNIT_TESTS = ("tests/config", "tests/distributed", "tests/v1", "tests/entrypoints")
# Carried bases with a stand-in venv that serves (its setup script), and what is
# served there; the other carried bases get the unit-test stand-in.
SERVING_STANDINS = {"0.34.0": "tools/setup-serving-standin.sh"}
SERVED_TESTS = (
    "tests/v1/e2e/test_cpu_routed_experts.py",
    "tests/v1/e2e/test_cpu_sampling_mask.py",
    "tests/v1/kv_connector/test_pd_routed_experts_e2e.py::test_pd_rows_equal_colocated_rows",
)
# The demo's verdict line (tools/demo.py prints it last).
DEMO_VERDICT = (r"^P/D rows \(rows-over-nixl\) equal colocated rows: True; tokens equal: True$")


@dataclass(frozen=True)
class Step:
    """One command, run from the repository root."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    # A regular expression (multi-line) the output must match, else the step fails.
    expect: str | None = None


@dataclass(frozen=True)
class Lane:
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Stage:
    lanes: tuple[Lane, ...]


@dataclass
class Result:
    step: Step
    code: int | None = None  # None: not run
    seconds: float = 0.0
    problem: str = ""

    @property
    def passed(self) -> bool:
        return self.code == 0 and not self.problem


def serial(*steps: Step) -> Stage:
    return Stage((Lane(tuple(steps)),))


def beside(*lanes: Sequence[Step]) -> Stage:
    return Stage(tuple(Lane(tuple(lane)) for lane in lanes if lane))


def base_python(root: Path, release: str) -> str:
    return str(root / f".venv-{release}" / "bin" / "python")


def carried_base_steps(root: Path, release: str, python: str,
                       pytest_args: tuple[str, ...]) -> tuple[list[Step], Step, list[Step]]:
    """A carried base's venv and unit tests, its upstream fast set, and its checks
    (check-prs, and the served tests where its stand-in serves)."""
    venv = str(root / f".venv-{release}")
    standin = SERVING_STANDINS.get(release)
    setup = (Step(f"{release}: venv (serving stand-in)", ("bash", standin),
                  {"VENV": venv, "VLLM_FORK_RELEASE": release})
             if standin else
             Step(f"{release}: venv (stand-in)", ("bash", "tools/setup-test-env.sh"),
                  {"VENV": venv, "VLLM_FORK_RELEASE": release}))
    cpu = standin_env()
    unit = Step(f"{release}: the series' unit tests",
                (base_python(root, release), "-m", "pytest", *BASE_UNIT_TESTS, "-m",
                 "not e2e", *pytest_args), cpu)
    upstream = fast_set_step(python, release)
    checks = [Step(f"{release}: check-prs", (python, "-m", "tools.fork", "check-prs",
                                              "--base-release", release,
                                              "--python", base_python(root, release)))]
    if standin:
        checks.append(Step(f"{release}: served tests",
                           (base_python(root, release), "-m", "pytest", "-m", "e2e",
                            *SERVED_TESTS, *pytest_args), cpu))
    return [setup, unit], upstream, checks


def pytest_step(part: str, markers: str, python: str,
                pytest_args: tuple[str, ...]) -> Step:
    """pytest over tests/, the tests `markers` selects."""
    return Step(f"pytest over tests/: {part}",
                (python, "-m", "pytest", "tests", "-m", markers, "--durations=15",
                 *pytest_args))


def plan(root: Path, python: str, pytest_args: tuple[str, ...] = ()) -> list[Stage]:
    """What `make test` runs, in order."""
    primary = load_pins(root / "pins.toml").release
    newest = newest_release(root)
    carried = [r for r in base_releases(root) if r != primary]
    demo = Step("demo (make demo)", (python, "-m", "tools.demo"), expect=DEMO_VERDICT)
    served = [pytest_step("served", f"e2e and {NOT_IN_MAKE_TEST}", python, pytest_args)]
    units = [pytest_step("unit", f"not e2e and {NOT_IN_MAKE_TEST}", python, pytest_args),
             Step("lint, every base", (python, "-m", "tools.fork", "lint", "--all-bases")),
             demo]
    upstream = [fast_set_step(python, newest)] if newest == primary else []
    checks: list[Step] = []
    for release in carried:
        setup, fast_set, base_checks = carried_base_steps(root, release, python,
                                                          pytest_args)
        units += setup
        if release == newest:
            upstream.append(fast_set)
        checks += base_checks
    return [beside(served, units), beside(upstream, checks)]


def fast_set_step(python: str, release: str) -> Step:
    """Upstream's fast set on one base, compared with its recorded stock outcomes."""
    return Step(f"{release}: upstream's fast set",
                (python, "-m", "tools.fork", "upstream-tests", "--base-release", release))


def select(stages: list[Stage], patterns: Sequence[str]) -> list[Stage]:
    """Only the steps whose name matches one of the shell-style `patterns`."""
    chosen = []
    for stage in stages:
        lanes = tuple(Lane(tuple(s for s in lane.steps
                                 if any(fnmatch.fnmatch(s.name, p) for p in patterns)))
                      for lane in stage.lanes)
        lanes = tuple(lane for lane in lanes if lane.steps)
        if lanes:
            chosen.append(Stage(lanes))
    return chosen


def clock() -> str:
    return time.strftime("%H:%M:%S", time.gmtime())


def run_step(step: Step, root: Path, live: bool, out: list[str]) -> Result:
    """Run one step; its output goes to `out` (and to stdout now, when `live`)."""
    header = f"== {clock()} {step.name}: {shlex.join(step.argv)}"
    out.append(header + "\n")
    if live:
        print(header, flush=True)
    env = dict(os.environ, **step.env)
    start = time.monotonic()
    lines: list[str] = []
    try:
        process = subprocess.Popen(step.argv, cwd=root, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   errors="replace")
    except OSError as exc:
        return Result(step, 127, 0.0, f"could not start: {exc}")
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if live:
            sys.stdout.write(line)
            sys.stdout.flush()
    code = process.wait()
    out.extend(lines)
    result = Result(step, code, time.monotonic() - start)
    if code != 0:
        result.problem = f"exit {code}"
    elif step.expect and not re.search(step.expect, "".join(lines), re.M):
        result.problem = f"its output lacks a line matching {step.expect!r}"
    footer = (f"-- {step.name}: {'ok' if result.passed else 'FAILED (' + result.problem + ')'}"
              f" in {result.seconds:.0f} s")
    out.append(footer + "\n")
    if live:
        print(footer, flush=True)
    return result


def run_lane(lane: Lane, root: Path, live: bool, out: list[str],
             results: list[Result]) -> None:
    for step in lane.steps:
        result = run_step(step, root, live, out)
        results.append(result)
        if not result.passed:
            results.extend(Result(s) for s in lane.steps[lane.steps.index(step) + 1:])
            return


def run_stage(stage: Stage, root: Path) -> list[Result]:
    """Run the lanes side by side; the first lane prints as it goes, the others'
    output follows when they end (in lane order)."""
    outputs: list[list[str]] = [[] for _ in stage.lanes]
    per_lane: list[list[Result]] = [[] for _ in stage.lanes]
    threads = [threading.Thread(target=run_lane,
                                args=(lane, root, i == 0, outputs[i], per_lane[i]))
               for i, lane in enumerate(stage.lanes)]
    if len(threads) > 1:
        names = "; ".join(", ".join(s.name for s in lane.steps) for lane in stage.lanes)
        print(f"== {clock()} side by side: {names}", flush=True)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for output in outputs[1:]:
        sys.stdout.write("".join(output))
    sys.stdout.flush()
    return [result for results in per_lane for result in results]


def run(stages: list[Stage], root: Path) -> list[Result]:
    results: list[Result] = []
    for index, stage in enumerate(stages):
        stage_results = run_stage(stage, root)
        results += stage_results
        if not all(r.passed for r in stage_results):
            results += [Result(step) for later in stages[index + 1:]
                        for lane in later.lanes for step in lane.steps]
            break
    return results


def summary(results: list[Result]) -> str:
    width = max((len(r.step.name) for r in results), default=4)
    lines = ["", f"{'phase':<{width}}  result  seconds"]
    for r in results:
        state = "ok" if r.passed else ("not run" if r.code is None else "FAILED")
        lines.append(f"{r.step.name:<{width}}  {state:<7} {r.seconds:>7.0f}"
                     + (f"  ({r.problem})" if r.problem and r.code is not None else ""))
    passed = sum(r.passed for r in results)
    failed = sum(r.code is not None and not r.passed for r in results)
    lines.append(f"ci: {passed} passed, {failed} failed")
    return "\n".join(lines)


def main(root: Path, python: str, only: Sequence[str], pytest_args: str,
         list_only: bool) -> int:
    stages = plan(root, python, tuple(shlex.split(pytest_args)))
    if only:
        stages = select(stages, only)
        if not stages:
            print(f"ci: no phase matches {list(only)}; `python -m tools.fork ci --list` "
                  "lists them", file=sys.stderr)
            return 2
    if list_only:
        for number, stage in enumerate(stages, 1):
            for lane in stage.lanes:
                kind = "beside" if len(stage.lanes) > 1 else "      "
                for step in lane.steps:
                    print(f"{number:>2} {kind}  {step.name}")
        return 0
    results = run(stages, root)
    print(summary(results), flush=True)
    return 0 if all(r.passed for r in results) else 1
