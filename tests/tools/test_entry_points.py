"""No module imports one of the harness's entry points (a module under tools/e2e that
runs as `python -m ...`: it has `if __name__ == "__main__":`, or is a `__main__.py`).
What two entry points share lives in a module of its own (tools/e2e/pd_pair.py for
prefill_lost, lease_expiry and soak), so an entry point can change its flags and
output without breaking another. Tests may import entry points; they test them.

Exempt: two libraries whose command line only serves make: the fault registry (its
queries; tools/e2e/plan.py reads it as a library) and make e2e's plan (tools/e2e/plan.py;
tools/forkbuild/ci.py reads its marker list). Outside tools/e2e
(tools/testbed/tiny_moe.py, benchmarks/) a module with a command line is also a
library on purpose; that is not checked here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("tools", "benchmarks")  # where imports are looked for
HARNESS = "tools/e2e"  # where entry points are
LIBRARIES = {"tools.e2e.fault_registry", "tools.e2e.plan"}
MAIN_GUARD = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.M)


def entry_points(root: Path) -> set[str]:
    """Dotted names of the modules under `root`/tools/e2e that run as `python -m`."""
    found = set()
    for path in (root / HARNESS).rglob("*.py"):
        if path.name == "__main__.py" or MAIN_GUARD.search(path.read_text()):
            found.add(".".join(path.relative_to(root).with_suffix("").parts))
    return found - LIBRARIES


def imports_of_entry_points(root: Path) -> list[str]:
    """`path: module` for each import of an entry point by another module there."""
    entries = entry_points(root)
    found = []
    for tree in TREES:
        for path in sorted((root / tree).rglob("*.py")):
            text = path.read_text()
            for module in re.findall(r"^\s*(?:from|import)\s+([\w.]+)", text, re.M):
                if module in entries:
                    found.append(f"{path.relative_to(root)}: {module}")
    return found


def test_the_walk_finds_the_entry_points() -> None:
    assert entry_points(ROOT) == {
        "tools.e2e.__main__", "tools.e2e.prefill_lost", "tools.e2e.lease_expiry",
        "tools.e2e.soak", "tools.e2e.pd_endpoints"}


def test_no_module_imports_an_entry_point() -> None:
    assert imports_of_entry_points(ROOT) == []


@pytest.mark.parametrize(("line", "caught"), [
    ("from tools.e2e.run import helper\n", True),
    ("    import tools.e2e.run\n", True),
    ("from tools.e2e.shared import helper\n", False),
])
def test_a_planted_import_of_an_entry_point_is_caught(
    tmp_path: Path, line: str, caught: bool
) -> None:
    """Negative control on a planted tree."""
    (tmp_path / "tools" / "e2e").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "tools" / "e2e" / "run.py").write_text('if __name__ == "__main__":\n    pass\n')
    (tmp_path / "tools" / "e2e" / "shared.py").write_text("helper = 1\n")
    (tmp_path / "benchmarks" / "other.py").write_text(line)
    assert imports_of_entry_points(tmp_path) == (
        ["benchmarks/other.py: tools.e2e.run"] if caught else [])
