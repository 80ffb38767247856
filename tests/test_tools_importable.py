"""Every module under tools/ and benchmarks/ imports, and none reaches into tests/.

The modules are found by walking the two trees (every `*.py`, as a dotted name from
the repository root) and imported in one fresh interpreter, so a module whose imports
are broken fails here even when no test or make target runs it. That interpreter
runs without E2E_FAULT: tools/e2e/faults/sitecustomize.py, which the harness puts on
the PYTHONPATH of the servers it starts, only defines its faults and installs an
import hook when E2E_FAULT names one, so without it importing the file is safe and
is checked like the rest.

tools/__init__.py promises that nothing under tools/ imports from tests/; neither may
benchmarks/, and neither edits `sys.path` (both are imported as packages from the
repository root). It also makes tools/testbed the bottom layer: tests, tools and
benchmarks import it, and it imports nothing else of the repository. Each check has a
negative control on a planted tree.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("tools", "benchmarks")
MARK = "importable: "
# In a fresh interpreter: import each named module, print the failures as JSON.
IMPORT_ALL = f"""
import importlib, json, sys
failures = {{}}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failures[name] = f"{{type(exc).__name__}}: {{exc}}"
print({MARK!r} + json.dumps(failures))
"""
FROM_TESTS = re.compile(r"^\s*(from\s+tests(\.\w+)*\s+import\b|import\s+tests\b)")
SYS_PATH_INSERT = "sys.path.insert"
# An import, from tools/testbed, of the repository outside tools/testbed.
TESTBED = "tools/testbed"
ABOVE_TESTBED = re.compile(r"^\s*(from|import)\s+(tools(?!\.testbed\b)(\.|\s|$)|benchmarks\b)")


def module_names(root: Path, trees: tuple[str, ...] = TREES) -> list[str]:
    """Every `*.py` under `root/tree` as the dotted name it imports by from `root`
    (a package's `__init__.py` as the package)."""
    names: list[str] = []
    for tree in trees:
        for path in sorted((root / tree).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def broken_imports(root: Path, names: list[str]) -> dict[str, str]:
    """The modules among `names` that fail to import in a fresh interpreter whose
    working directory and first path entry are `root`, with the error of each."""
    env = {key: value for key, value in os.environ.items() if key != "E2E_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", IMPORT_ALL, *names], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith(MARK)]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1][len(MARK):])


def offending_lines(root: Path, matches: re.Pattern[str] | str,
                    trees: tuple[str, ...] = TREES) -> list[str]:
    """`path:line: text` of every line under `root/tree` that `matches` (a regex, or
    a plain string it must contain)."""
    found: list[str] = []
    for tree in trees:
        for path in sorted((root / tree).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                hit = (matches.search(line) if isinstance(matches, re.Pattern)
                       else matches in line)
                if hit:
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_every_module_under_tools_and_benchmarks_imports() -> None:
    names = module_names(ROOT)
    # The walk found the trees (a few modules it must list, one of each kind).
    assert {"tools", "tools.e2e.__main__", "tools.e2e.harness",
            "tools.e2e.faults.sitecustomize", "benchmarks.scheduler_step"} <= set(names)
    assert broken_imports(ROOT, names) == {}


def test_a_broken_import_is_reported(tmp_path: Path) -> None:
    """Negative control: a planted package with a module whose import fails, one
    that fails to parse and one that exits while importing."""
    package = tmp_path / "planted"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "fine.py").write_text("import json\n")
    (package / "missing.py").write_text("from planted.fine import does_not_exist\n")
    (package / "sub" / "unparsable.py").write_text("def broken(:\n")
    (package / "exits.py").write_text("import sys\nsys.exit(3)\n")
    names = module_names(tmp_path, ("planted",))
    assert names == ["planted", "planted.exits", "planted.fine", "planted.missing",
                     "planted.sub.unparsable"]
    broken = broken_imports(tmp_path, names)
    assert sorted(broken) == ["planted.exits", "planted.missing", "planted.sub.unparsable"]
    assert broken["planted.missing"].startswith("ImportError: cannot import name")
    assert broken["planted.sub.unparsable"].startswith("SyntaxError")
    assert broken["planted.exits"] == "SystemExit: 3"


def test_nothing_under_tools_or_benchmarks_imports_from_tests() -> None:
    assert offending_lines(ROOT, FROM_TESTS) == []


def test_nothing_under_tools_or_benchmarks_edits_sys_path() -> None:
    assert offending_lines(ROOT, SYS_PATH_INSERT) == []


def test_the_testbed_imports_nothing_above_it() -> None:
    assert offending_lines(ROOT, ABOVE_TESTBED, (TESTBED,)) == []


@pytest.mark.parametrize(("planted", "caught"), [
    ("from tools.e2e.cluster import Cluster\n", True),
    ("    import tools.e2e.aliases\n", True),
    ("from tools import fork\n", True),
    ("from benchmarks.block_bytes import Shape\n", True),
    ("from tools.testbed.aliases import deprecated_alias\n", False),
    ("from tools.testbedding import x\n", True),  # not the testbed package
    ("from vllm.config import VllmConfig\n", False),
])
def test_the_layer_check_catches_a_planted_import(
    tmp_path: Path, planted: str, caught: bool
) -> None:
    """Negative control: the testbed check over a planted tools/testbed tree."""
    (tmp_path / TESTBED).mkdir(parents=True)
    (tmp_path / TESTBED / "planted.py").write_text(f"import os\n{planted}")
    want = [f"{TESTBED}/planted.py:2: {planted.strip()}"] if caught else []
    assert offending_lines(tmp_path, ABOVE_TESTBED, (TESTBED,)) == want


@pytest.mark.parametrize(
    ("planted", "matches", "caught"),
    [
        ("from tests.rows_spec import spec_chains\n", FROM_TESTS, True),
        ("    from tests import conftest\n", FROM_TESTS, True),
        ("import tests.dash_o\n", FROM_TESTS, True),
        ("import tests\n", FROM_TESTS, True),
        ('sys.path.insert(0, str(ROOT / "tests"))\n', SYS_PATH_INSERT, True),
        # Not imports from tests/: a sibling name, and prose about the rule.
        ("from testsuite import run\n", FROM_TESTS, False),
        ('"""Nothing under tools/ imports from tests/."""\n', FROM_TESTS, False),
    ],
)
def test_the_grep_checks_catch_a_planted_line(
    tmp_path: Path, planted: str, matches: re.Pattern[str] | str, caught: bool
) -> None:
    """Negative control: the same checks over a planted tools/ tree."""
    (tmp_path / "tools" / "deep").mkdir(parents=True)
    (tmp_path / "tools" / "clean.py").write_text("import sys\n")
    (tmp_path / "tools" / "deep" / "planted.py").write_text(f"import os\n{planted}")
    want = [f"tools/deep/planted.py:2: {planted.strip()}"] if caught else []
    assert offending_lines(tmp_path, matches) == want
