"""The drift report (`python -m tools.fork drift`): one fake release per outcome.

The fake series' one patch (fakefork.PATCH_GOOD) edits vllm/greeting.py; each test
makes a release whose sources give one status. A release that ships a file at a fork
module's path is reported as shadowing it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.fork_build.fakefork import GREETING_PY, PATCH_GOOD
from tools.forkbuild.drift import (
    CLEAN,
    CONFLICTS,
    OFFSETS,
    UPSTREAM,
    drift,
    markdown,
    shadowed_modules,
)
from tools.forkbuild.series import parse_patch

POLITE = GREETING_PY.replace('"hello " + name', '"good day, " + name')


def _release(tmp_path: Path, greeting: str, added: str | None = None) -> Path:
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "greeting.py").write_text(greeting)
    if added is not None:
        (tree / "vllm" / "added.py").write_text(added)
    return tree


def _patch(tmp_path: Path):
    path = tmp_path / "0001-greet-politely.patch"
    path.write_text(PATCH_GOOD)
    return parse_patch(path)


@pytest.mark.parametrize(
    ("greeting", "added", "status", "detail"),
    [
        (GREETING_PY, None, CLEAN, ()),
        (
            GREETING_PY.replace('"hello "', '"hi "'),
            None,
            CONFLICTS,
            ("file vllm/greeting.py, hunk @@ -1,5 +1,5 @@",),
        ),
        (POLITE, "ADDED = True\n", UPSTREAM, ()),
    ],
)
def test_each_outcome(
    tmp_path: Path,
    greeting: str,
    added: str | None,
    status: str,
    detail: tuple[str, ...],
) -> None:
    tree = _release(tmp_path, greeting, added)
    [row] = drift(tree, [_patch(tmp_path)], "fake 9.9.9")
    assert (row.status, row.alone) == (status, status)
    assert row.details == detail
    assert not (tmp_path / "tree-pristine").exists()


MIDDLE = "".join(f"line {i}\n" for i in range(1, 11))
PATCH_MIDDLE = (
    PATCH_GOOD.split("diff --git", 1)[0]
    + """\
diff --git a/vllm/middle.py b/vllm/middle.py
--- a/vllm/middle.py
+++ b/vllm/middle.py
@@ -3,7 +3,7 @@
 line 3
 line 4
 line 5
-line 6
+line six
 line 7
 line 8
 line 9
"""
)


def test_moved_hunks_are_offsets_with_the_distance(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "middle.py").write_text("import os\nimport sys\n" + MIDDLE)
    path = tmp_path / "0002-middle.patch"
    path.write_text(PATCH_MIDDLE)
    [row] = drift(tree, [parse_patch(path)], "fake 9.9.9")
    assert (row.status, row.alone) == (OFFSETS, OFFSETS)
    assert row.details == ("vllm/middle.py: hunk 1 moved by 2 lines",)
    assert (tree / "vllm" / "middle.py").read_text().count("line six") == 1


def test_a_conflict_is_skipped_and_later_patches_say_so(tmp_path: Path) -> None:
    tree = _release(tmp_path, GREETING_PY.replace('"hello "', '"hi "'))
    patch = _patch(tmp_path)
    rows = drift(tree, [patch, patch], "fake 9.9.9")
    assert [r.status for r in rows] == [CONFLICTS, CONFLICTS]
    assert rows[1].details[-1] == "tried without the earlier conflicting 0001"


def test_markdown_counts_each_status(tmp_path: Path) -> None:
    tree = _release(tmp_path, GREETING_PY)
    rows = drift(tree, [_patch(tmp_path)], "fake 9.9.9")
    wheel = tmp_path / "vllm_fake-9.9.9-x.whl"
    wheel.write_bytes(b"not a real wheel")
    text = markdown("fake 9.9.9", wheel, rows)
    assert (
        "| `0001-greet-politely.patch` | applies cleanly | applies cleanly |  |" in text
    )
    assert text.endswith("1 applies cleanly.")


def test_a_release_shipping_a_module_path_is_reported(tmp_path: Path) -> None:
    modules = {"vllm/added.py": tmp_path / "added.py", "vllm/own.py": tmp_path / "own.py"}
    names = {"vllm/__init__.py", "vllm/added.py"}
    assert shadowed_modules(modules, names) == ["vllm/added.py"]
    tree = _release(tmp_path, GREETING_PY)
    rows = drift(tree, [_patch(tmp_path)], "fake 9.9.9")
    wheel = tmp_path / "vllm_fake-9.9.9-x.whl"
    wheel.write_bytes(b"not a real wheel")
    text = markdown("fake 9.9.9", wheel, rows, ["vllm/added.py"])
    assert text.endswith("Shadowed: this release ships 1 of the fork's module paths "
                         "itself (the build refuses them; rename the module or move its "
                         "code into upstream's file):\n\n- `vllm/added.py`")
