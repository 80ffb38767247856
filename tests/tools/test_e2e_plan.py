"""`make e2e` as data (tools/e2e/plan.py): what each end-to-end target runs.

The expected commands below are typed by hand: they are what the Makefile ran when it
computed them itself (`make -n e2e FAULT=x`, `e2e-rows-transfer`, `e2e-lease`, recorded
before the routing moved to tools/e2e/plan.py), less the `venv` setup that each
recursive make ran again. A fault the registry gains must be added here by hand too
(`test_the_table_covers_every_registered_fault`). The Makefile side: each target is
one line calling the plan (`make -n`), the old target name warns once and plans the
new one, and a fault make e2e does not plant stops make before anything runs.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.e2e import fault_registry as registry
from tools.e2e import plan

ROOT = Path(__file__).resolve().parents[2]

MOONCAKE = "bash tools/setup-mooncake.sh"
PYTEST = ('PY -m pytest tests -m '
          '"(e2e_control or e2e_store or e2e_full or pr_stack) and not ray_serve"')
ROWS = "PY -m tools.e2e --routed-experts-transfer --router vllm-router"
RECOMPUTE = "--kv-load-failure-policy recompute"
ROWS_RUN = [
    ROWS,
    "PY -m tools.e2e.prefill_lost --policy recompute",
    "PY -m tools.e2e.prefill_lost --policy fail",
    "PY -m tools.e2e.pd_endpoints --mode rows-over-nixl",
]
LEASE_RUN = [
    "PY -m tools.e2e.lease_expiry",
    "PY -m tools.e2e.lease_expiry --policy fail",
    "PY -m tools.e2e.lease_expiry --routed-experts-transfer",
]
REFUSED = None  # the plan refuses the fault: nothing runs

# (target, fault) -> the commands, `PY` for the Python that runs the plan.
EXPECTED: dict[tuple[str, str | None], list[str] | None] = {
    ("e2e", None): [MOONCAKE, PYTEST, "PY -m tools.e2e", "PY -m tools.e2e.pd_endpoints",
                    *ROWS_RUN, *LEASE_RUN],
    ("e2e", "no-floor"): [MOONCAKE, "PY -m tools.e2e --fault no-floor"],
    ("e2e", "no-skip"): [MOONCAKE, "PY -m tools.e2e --fault no-skip"],
    ("e2e", "shift-decode-rows"): [MOONCAKE, "PY -m tools.e2e --fault shift-decode-rows",
                                   "PY -m tools.e2e.pd_endpoints --fault shift-decode-rows"],
    ("e2e", "no-clamp"): [MOONCAKE, "PY -m tools.e2e --fault no-clamp"],
    ("e2e", "no-row-transfer"): [MOONCAKE, f"{ROWS} --fault no-row-transfer"],
    ("e2e", "corrupt-row-tag"): [MOONCAKE, f"{ROWS} --fault corrupt-row-tag {RECOMPUTE}"],
    ("e2e", "rows-not-imported"): [MOONCAKE, f"{ROWS} --fault rows-not-imported"],
    ("e2e", "corrupt-rows"): [MOONCAKE, f"{ROWS} --fault corrupt-rows {RECOMPUTE}"],
    ("e2e", "leak-floors"): [MOONCAKE, "PY -m tools.e2e --fault leak-floors"],
    ("e2e", "hold-finished-blocks"): [MOONCAKE, "PY -m tools.e2e --fault hold-finished-blocks"],
    ("e2e", "no-lease-check"): [MOONCAKE, "PY -m tools.e2e.lease_expiry --fault no-lease-check"],
    ("e2e", "unbounded-pd-decode-loads"): REFUSED,
    ("e2e", "uncapped-store-lookups"): REFUSED,
    ("e2e", "reversed-role-chains"): REFUSED,
    ("e2e", "unshared-handoff-loads"): REFUSED,
    ("e2e", "bogus"): REFUSED,
    # The two parts run their first command with any registered fault (its entry
    # point refuses one it does not plant, as it did when make ran it).
    ("e2e-routed-experts-transfer", None): ROWS_RUN,
    ("e2e-routed-experts-transfer", "no-floor"): [f"{ROWS} --fault no-floor"],
    ("e2e-routed-experts-transfer", "no-skip"): [f"{ROWS} --fault no-skip"],
    ("e2e-routed-experts-transfer", "shift-decode-rows"): [f"{ROWS} --fault shift-decode-rows"],
    ("e2e-routed-experts-transfer", "no-clamp"): [f"{ROWS} --fault no-clamp"],
    ("e2e-routed-experts-transfer", "no-row-transfer"): [f"{ROWS} --fault no-row-transfer"],
    ("e2e-routed-experts-transfer", "corrupt-row-tag"): [
        f"{ROWS} --fault corrupt-row-tag {RECOMPUTE}"],
    ("e2e-routed-experts-transfer", "rows-not-imported"): [
        f"{ROWS} --fault rows-not-imported"],
    ("e2e-routed-experts-transfer", "corrupt-rows"): [f"{ROWS} --fault corrupt-rows {RECOMPUTE}"],
    ("e2e-routed-experts-transfer", "leak-floors"): [f"{ROWS} --fault leak-floors"],
    ("e2e-routed-experts-transfer", "hold-finished-blocks"): [
        f"{ROWS} --fault hold-finished-blocks"],
    ("e2e-routed-experts-transfer", "no-lease-check"): [f"{ROWS} --fault no-lease-check"],
    ("e2e-routed-experts-transfer", "unbounded-pd-decode-loads"): [
        f"{ROWS} --fault unbounded-pd-decode-loads"],
    ("e2e-routed-experts-transfer", "uncapped-store-lookups"): [
        f"{ROWS} --fault uncapped-store-lookups"],
    ("e2e-routed-experts-transfer", "reversed-role-chains"): [
        f"{ROWS} --fault reversed-role-chains"],
    ("e2e-routed-experts-transfer", "unshared-handoff-loads"): [
        f"{ROWS} --fault unshared-handoff-loads"],
    ("e2e-routed-experts-transfer", "bogus"): REFUSED,
    ("e2e-lease", None): LEASE_RUN,
    ("e2e-lease", "no-floor"): ["PY -m tools.e2e.lease_expiry --fault no-floor"],
    ("e2e-lease", "no-skip"): ["PY -m tools.e2e.lease_expiry --fault no-skip"],
    ("e2e-lease", "shift-decode-rows"): ["PY -m tools.e2e.lease_expiry --fault shift-decode-rows"],
    ("e2e-lease", "no-clamp"): ["PY -m tools.e2e.lease_expiry --fault no-clamp"],
    ("e2e-lease", "no-row-transfer"): ["PY -m tools.e2e.lease_expiry --fault no-row-transfer"],
    ("e2e-lease", "corrupt-row-tag"): ["PY -m tools.e2e.lease_expiry --fault corrupt-row-tag"],
    ("e2e-lease", "rows-not-imported"): [
        "PY -m tools.e2e.lease_expiry --fault rows-not-imported"],
    ("e2e-lease", "corrupt-rows"): ["PY -m tools.e2e.lease_expiry --fault corrupt-rows"],
    ("e2e-lease", "leak-floors"): ["PY -m tools.e2e.lease_expiry --fault leak-floors"],
    ("e2e-lease", "hold-finished-blocks"): [
        "PY -m tools.e2e.lease_expiry --fault hold-finished-blocks"],
    ("e2e-lease", "no-lease-check"): ["PY -m tools.e2e.lease_expiry --fault no-lease-check"],
    ("e2e-lease", "unbounded-pd-decode-loads"): [
        "PY -m tools.e2e.lease_expiry --fault unbounded-pd-decode-loads"],
    ("e2e-lease", "uncapped-store-lookups"): [
        "PY -m tools.e2e.lease_expiry --fault uncapped-store-lookups"],
    ("e2e-lease", "reversed-role-chains"): [
        "PY -m tools.e2e.lease_expiry --fault reversed-role-chains"],
    ("e2e-lease", "unshared-handoff-loads"): [
        "PY -m tools.e2e.lease_expiry --fault unshared-handoff-loads"],
    ("e2e-lease", "bogus"): REFUSED,
}
TARGETS = ("e2e", "e2e-routed-experts-transfer", "e2e-lease")


def _argv(command: str) -> tuple[str, ...]:
    return tuple(sys.executable if word == "PY" else word for word in shlex.split(command))


def _case_id(case: tuple[str, str | None]) -> str:
    return f"{case[0]}-{case[1] or 'no-fault'}"


def test_the_table_covers_every_registered_fault() -> None:
    assert plan.TARGETS == TARGETS
    for target in TARGETS:
        faults = {fault for t, fault in EXPECTED if t == target}
        assert faults == {None, "bogus", *registry.BY_NAME}, target


@pytest.mark.parametrize("case", sorted(EXPECTED, key=_case_id), ids=_case_id)
def test_the_plan_runs_what_make_ran(case: tuple[str, str | None]) -> None:
    target, fault = case
    expected = EXPECTED[case]
    if expected is REFUSED:
        with pytest.raises(registry.UnknownFault):
            plan.plan(target, fault, python=sys.executable)
    else:
        assert plan.plan(target, fault, python=sys.executable) == [_argv(c) for c in expected]


@pytest.mark.parametrize("case", [("e2e", None), ("e2e", "corrupt-rows"),
                                  ("e2e-lease", "no-lease-check")], ids=_case_id)
def test_dry_run_prints_the_plan_one_command_a_line(
    case: tuple[str, str | None], capsys: pytest.CaptureFixture[str],
) -> None:
    target, fault = case
    assert plan.main([target, *(["--fault", fault] if fault else []), "--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [tuple(shlex.split(line)) for line in printed] == [_argv(c) for c in EXPECTED[case]]


@pytest.mark.parametrize(("fault", "says"), [
    ("bogus", "unknown fault 'bogus'"),
    ("uncapped-store-lookups", "make e2e does not plant 'uncapped-store-lookups'"),
    ("unbounded-pd-decode-loads", "test_rows_with_kv_store_reload_e2e.py"),
])
def test_a_refused_fault_exits_2_with_the_registry_message(
    fault: str, says: str, capsys: pytest.CaptureFixture[str],
) -> None:
    assert plan.main(["--fault", fault, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"FAULT={fault}: ") and says in captured.err


def test_run_stops_at_the_first_failure_with_its_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    python = sys.executable
    commands = [
        (python, "-c", "open('first', 'w')"),
        (python, "-c", "import sys; sys.exit(3)"),
        (python, "-c", "open('third', 'w')"),
    ]
    assert plan.run(commands, root=tmp_path) == 3
    assert (tmp_path / "first").exists() and not (tmp_path / "third").exists()
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [shlex.join(c) for c in commands[:2]]  # echoed
    assert "exited 3; 1 later command not run" in captured.err
    assert plan.run(commands[:1], root=tmp_path) == 0


# -- the Makefile's side ---------------------------------------------------------------

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _make(*args: str, dry: bool = True) -> subprocess.CompletedProcess[str]:
    """make from the repository root; `dry`: -n, else for real without the venv
    prerequisite (-o venv), which only the refusals below may do."""
    flags = ["-n"] if dry else ["-o", "venv"]
    return subprocess.run(["make", *flags, "--no-print-directory", *args,
                           f"PY={sys.executable}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def _commands(output: str) -> list[list[str]]:
    """The commands a recipe runs (`make -n` output or the echo of a real run)."""
    joined = re.sub(r"\\\n", " ", output)
    return [shlex.split(line) for line in joined.splitlines() if line.strip()]


@needs_make
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fault", [None, "no-floor", "corrupt-rows"])
def test_each_make_target_is_one_line_calling_the_plan(target: str, fault: str | None) -> None:
    run = _make(target, *([f"FAULT={fault}"] if fault else []))
    assert run.returncode == 0, run.stderr
    assert _commands(run.stdout) == [
        ["bash", "tools/setup-test-env.sh"],
        [sys.executable, "-m", "tools.e2e.plan", target, *(["--fault", fault] if fault else [])],
    ]


@needs_make
def test_the_old_target_name_plans_the_new_one_and_says_so() -> None:
    run = _make("e2e-rows-transfer", "FAULT=corrupt-rows")
    assert run.returncode == 0, run.stderr
    commands = _commands(run.stdout)
    assert commands[-1] == [sys.executable, "-m", "tools.e2e.plan",
                            "e2e-routed-experts-transfer", "--fault", "corrupt-rows"]
    # For real: the one deprecation line, then the plan refuses an unknown fault.
    real = _make("e2e-rows-transfer", "FAULT=bogus", dry=False)
    assert real.returncode != 0
    lines = real.stderr.splitlines()
    assert lines[0] == ("make: e2e-rows-transfer is deprecated; use make "
                        "e2e-routed-experts-transfer")
    assert sum("deprecated" in line for line in lines) == 1
    assert lines[1].startswith("FAULT=bogus: unknown fault 'bogus'"), lines


@needs_make
@pytest.mark.parametrize(("fault", "says"), [
    ("bogus", "unknown fault 'bogus'"),
    ("uncapped-store-lookups", "make e2e does not plant 'uncapped-store-lookups'"),
    ("unbounded-pd-decode-loads", "test_rows_with_kv_store_reload_e2e.py"),
])
def test_make_e2e_stops_on_a_fault_it_does_not_plant(fault: str, says: str) -> None:
    run = _make("e2e", f"FAULT={fault}", dry=False)
    assert run.returncode != 0
    assert says in run.stderr and f"FAULT={fault}: " in run.stderr, run.stderr
    # Only the plan's own command line was echoed: nothing it plans ran.
    assert _commands(run.stdout) == [
        [sys.executable, "-m", "tools.e2e.plan", "e2e", "--fault", fault]]


@needs_make
def test_make_help_names_each_target() -> None:
    run = _make("help", dry=False)
    assert run.returncode == 0, run.stderr
    for target in (*TARGETS, "e2e-rows-transfer"):
        assert f"make {target}" in run.stdout, target
