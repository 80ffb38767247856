"""The fault registry (tools/e2e/fault_registry.py) is the one list of planted faults.

Checked against what reads or plants them: the planting table of
tools/e2e/faults/sitecustomize.py (the same names), each entry point's `--fault`
choices (the names each accepted before the registry, typed here), and every place
under tests/, tools/, docs/ and the Makefile that names a fault to plant (each name
must be registered; a planted unknown name is caught). What `make e2e FAULT=x` runs
for each fault is tests/tools/test_e2e_plan.py's to check.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from tools.e2e import fault_registry as registry

ROOT = Path(__file__).resolve().parents[2]

# The `--fault` choices each entry point had before the registry, in --help's order.
CHOICES = {
    registry.HARNESS: ("no-floor", "no-skip", "shift-decode-rows", "no-clamp",
                       "no-row-transfer", "corrupt-row-tag", "rows-not-imported",
                       "corrupt-rows", "leak-floors", "hold-finished-blocks"),
    registry.PD_ENDPOINTS: ("shift-decode-rows",),
    registry.SOAK: ("shift-decode-rows", "leak-floors"),
    registry.LEASE_EXPIRY: ("no-lease-check", "unbounded-pd-decode-loads"),
    registry.FAULTED_PYTEST: (
        "uncapped-store-lookups", "reversed-role-chains", "unshared-handoff-loads"),
}

# Where a fault to plant is named: `--fault X`, `FAULT=X`, `E2E_FAULT=X`,
# `run_under_fault("X"`, `fault="X"` (a flag and its value may be separate strings).
# A name has a hyphen (every registered one does), which keeps `E2E_FAULT=fault`, a
# Python keyword argument, out.
NAMED = re.compile(r"""(?:--fault(?:\s+|["']\s*,\s*["'])|\bE2E_FAULT=|\bFAULT="""
                   r"""|run_under_fault\(\s*["']|\bfault=["'])([a-z][a-z0-9]*(?:-[a-z0-9]+)+)""")
SCANNED = ("tests", "tools", "docs", "benchmarks")


def planted_table() -> tuple[dict[str, object], dict[str, object]]:
    """sitecustomize's FAULTS and ALSO, imported without E2E_FAULT."""
    module = importlib.import_module("tools.e2e.faults.sitecustomize")
    return module.FAULTS, module.ALSO


def test_the_registry_and_the_planting_table_name_the_same_faults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("E2E_FAULT", raising=False)
    planted, also = planted_table()
    assert list(registry.BY_NAME) == [f.name for f in registry.FAULTS]  # no duplicate
    assert set(registry.BY_NAME) == set(planted)
    assert set(also) <= set(planted)
    assert len(registry.FAULTS) == 15


def test_each_entry_is_well_formed() -> None:
    for fault in registry.FAULTS:
        assert fault.mode in registry.MODES, fault
        assert "-" in fault.name, fault  # what the scan below looks for
        assert fault.entry_points and set(fault.entry_points) <= set(registry.ENTRY_POINTS)
        assert fault.plants.endswith(".") and fault.control.endswith("."), fault
        pytest_only = fault.mode == registry.PYTEST_CONTROL
        assert pytest_only == (fault.entry_points == (registry.FAULTED_PYTEST,)), fault
        assert not (pytest_only and fault.make_e2e), fault
        if fault.mode in (registry.MERGE, registry.ROWS_TRANSFER):
            assert registry.HARNESS in fault.entry_points, fault


@pytest.mark.parametrize("entry_point", sorted(CHOICES))
def test_each_entry_point_accepts_what_it_accepted(entry_point: str) -> None:
    assert registry.choices(entry_point) == CHOICES[entry_point]


def test_the_rows_transfer_faults_are_those_that_need_the_switch() -> None:
    assert registry.in_mode(registry.ROWS_TRANSFER) == (
        "no-row-transfer", "corrupt-row-tag", "rows-not-imported", "corrupt-rows")
    assert registry.in_mode(registry.LEASE) == ("no-lease-check", "unbounded-pd-decode-loads")


def test_unknown_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(registry.UnknownFault, match="'bogus'.*no-floor, no-skip"):
        registry.fault("bogus")
    with pytest.raises(registry.UnknownFault, match="make e2e does not plant"):
        registry.make_mode("reversed-role-chains")
    with pytest.raises(ValueError, match="unknown entry point"):
        registry.choices("tools.e2e.nope")


def test_the_command_line_answers_mode_make_args_and_list(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert registry.main(["mode", "corrupt-rows"]) == 0
    assert registry.main(["make-args", "corrupt-rows"]) == 0
    assert registry.main(["make-args", "no-floor"]) == 0
    assert registry.main(["list", "--entry", registry.PD_ENDPOINTS]) == 0
    assert registry.main(["list", "--mode", registry.LEASE]) == 0
    assert capsys.readouterr().out == (
        "rows-transfer\n--kv-load-failure-policy recompute\n\nshift-decode-rows\n"
        "no-lease-check\nunbounded-pd-decode-loads\n")
    assert registry.main(["mode", "bogus"]) == 2
    assert "unknown fault 'bogus'" in capsys.readouterr().err


def test_the_docs_table_has_a_row_per_fault() -> None:
    rows = registry.markdown_table().splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [f"| `{f.name}`" for f in registry.FAULTS]
    assert "| `unbounded-pd-decode-loads` | lease-expiry, not in make e2e |" in rows[11]


def named_faults(text: str) -> list[str]:
    """The fault names `text` asks to plant."""
    return NAMED.findall(text)


def test_every_fault_named_anywhere_is_registered() -> None:
    paths = [ROOT / "Makefile"]
    for tree in SCANNED:
        paths += [p for p in sorted((ROOT / tree).rglob("*"))
                  if p.suffix in (".py", ".md") and "fork_build" not in p.parts
                  and p != Path(__file__).resolve()]  # this file plants unknown names
    found: dict[str, list[str]] = {}
    for path in paths:
        for name in named_faults(path.read_text(errors="replace")):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    # The scan sees the places it must (a test, an entry point's docstring, the docs).
    assert "tests/distributed/kv_transfer/test_role_chains_control.py" in found[
        "reversed-role-chains"]
    assert "tools/e2e/pd_endpoints.py" in found["shift-decode-rows"]
    assert "docs/testing.md" in found["no-floor"]
    unknown = {name: where for name, where in found.items() if name not in registry.BY_NAME}
    assert unknown == {}


@pytest.mark.parametrize(("text", "names"), [
    ('run_harness(tmp, "--fault", "no-florr")', ["no-florr"]),
    ("make e2e FAULT=bogus-fault   # a comment", ["bogus-fault"]),
    ('env["E2E_FAULT"] = fault; E2E_FAULT=uncapped-store-lookups', ["uncapped-store-lookups"]),
    ('run_under_fault(\n    "reversed-role-chains",', ["reversed-role-chains"]),
    ('"--fault", "no-lease-check"', ["no-lease-check"]),
    ("dict(os.environ, E2E_FAULT=fault)", []),  # a variable, not a name
    ('parser.add_argument("--fault",\n    choices=choices(SOAK)', []),  # not a value
    ("--faults decode-kill,prefill-kill", []),  # the soak's server kills, not planted
])
def test_the_scan_finds_a_planted_name(text: str, names: list[str]) -> None:
    """Negative control of the scan: names in each spelling are found."""
    assert named_faults(text) == names


@pytest.mark.parametrize(("module", "entry_point"), [
    ("tools.e2e.__main__", registry.HARNESS),
    ("tools.e2e.pd_endpoints", registry.PD_ENDPOINTS),
    ("tools.e2e.soak", registry.SOAK),
    ("tools.e2e.lease_expiry", registry.LEASE_EXPIRY),
])
def test_each_entry_point_lists_its_faults_in_help_and_refuses_others(
    module: str, entry_point: str, capsys: pytest.CaptureFixture[str],
) -> None:
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_help:
        main(["--help"])
    assert exit_help.value.code == 0
    assert "--fault {" + ",".join(CHOICES[entry_point]) + "}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_bad:
        main(["--fault", "reversed-role-chains"])
    assert exit_bad.value.code == 2
    assert "invalid choice: 'reversed-role-chains'" in capsys.readouterr().err
