"""The `fake_fork` fixture: a fresh fake repository, base wheel and cache per test."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.fork_build.fakefork import (
    ADDED_PY,
    BASE_FILENAME,
    PATCH_GOOD,
    PRS_TOML,
    FakeFork,
    write_wheel,
)


@pytest.fixture
def fake_fork(tmp_path: Path) -> FakeFork:
    cache = tmp_path / "cache"
    cache.mkdir()
    base = cache / BASE_FILENAME
    write_wheel(base)
    fork = FakeFork(root=tmp_path / "repo", cache=cache, base_wheel=base)
    fork.root.mkdir()
    fork.write_pins()
    fork.write_series({"0001-greet-politely.patch": PATCH_GOOD})
    fork.write_module("vllm/added.py", ADDED_PY)
    (fork.patches / "prs.toml").write_text(PRS_TOML)
    return fork
