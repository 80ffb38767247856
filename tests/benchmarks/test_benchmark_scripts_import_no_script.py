"""No benchmark imports another benchmark's script (a module under benchmarks/ with
`if __name__ == "__main__":`). What two scripts share lives in a library module
without a command line (measure, block_bytes, mooncake_store, request_set,
scheduler_rig, callgrind_shim, cpu_meter, rows_tally), so a script can change its flags, output and
internals without breaking another. Tests may import scripts; they test them.

tests/tools/test_entry_points.py checks the same for tools/e2e."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREE = "benchmarks"
MAIN_GUARD = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.M)
# `from a.b import c` (c may be a module), `import a.b`, `from a import (c, d)`.
IMPORT = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+(\([^)]*\)|[^\n]*)|^\s*import\s+([\w.]+)",
                    re.M)


def scripts(root: Path) -> set[str]:
    """Dotted names of the modules under `root`/benchmarks that run as `python -m`."""
    return {".".join(path.relative_to(root).with_suffix("").parts)
            for path in (root / TREE).rglob("*.py") if MAIN_GUARD.search(path.read_text())}


def imported(text: str) -> set[str]:
    """Every module `text` imports, with `from package import module` as
    `package.module` too."""
    found = set()
    for source, names, plain in IMPORT.findall(text):
        if plain:
            found.add(plain)
            continue
        found.add(source)
        for name in re.findall(r"\w+(?:\s+as\s+\w+)?", names.strip("()")):
            found.add(f"{source}.{name.split()[0]}")
    return found


def imports_of_scripts(root: Path) -> list[str]:
    """`path: module` for each import of a script by another module under benchmarks."""
    entries = scripts(root)
    found = []
    for path in sorted((root / TREE).rglob("*.py")):
        for module in sorted(imported(path.read_text()) & entries):
            found.append(f"{path.relative_to(root)}: {module}")
    return found


def test_the_walk_finds_the_scripts() -> None:
    assert {"benchmarks.rows_transfer_bytes", "benchmarks.cpu_per_request",
            "benchmarks.scheduler_step", "benchmarks.mooncake_store_rows_cost",
            "benchmarks.gpu.r3_cost"} <= scripts(ROOT)
    assert "benchmarks.block_bytes" not in scripts(ROOT)


def test_no_benchmark_imports_a_script() -> None:
    assert imports_of_scripts(ROOT) == []


@pytest.mark.parametrize(("line", "caught"), [
    ("from benchmarks.run import helper\n", True),
    ("    from benchmarks.run import helper\n", True),
    ("import benchmarks.run\n", True),
    ("from benchmarks import run as bench\n", True),
    ("from benchmarks import (\n    shared,\n    run,\n)\n", True),
    ("from benchmarks.shared import helper\n", False),
    ("from benchmarks import shared\n", False),
])
def test_a_planted_import_of_a_script_is_caught(
    tmp_path: Path, line: str, caught: bool
) -> None:
    """Negative control on a planted tree."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "run.py").write_text('if __name__ == "__main__":\n    pass\n')
    (tmp_path / "benchmarks" / "shared.py").write_text("helper = 1\n")
    (tmp_path / "benchmarks" / "other.py").write_text(line)
    assert imports_of_scripts(tmp_path) == (
        ["benchmarks/other.py: benchmarks.run"] if caught else [])
