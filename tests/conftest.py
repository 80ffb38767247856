"""Root conftest. It has no fixtures; it exists so pytest imports it as
`tests.conftest` and so puts the repository root on `sys.path` before collecting
anything (see tests/__init__.py), and it leaves out the test files of another
carried base's shape of a PR (tools/forkbuild/base_tests.py: each base's
`prs.toml` lists the files that test its shape)."""

from __future__ import annotations

from pathlib import Path

from tools.forkbuild.base_tests import installed_release, other_bases_only

ROOT = Path(__file__).resolve().parent.parent


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    if collection_path.suffix != ".py":
        return None
    try:
        relative = collection_path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    if relative in other_bases_only(ROOT, installed_release()):
        return True
    return None
