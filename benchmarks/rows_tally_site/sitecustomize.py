"""Loads benchmarks/rows_tally.py into every Python process of a server started with
`rows_tally.tally_env(...)` (R3_TALLY_DIR set). Benchmark tooling: never part of
the fork wheel."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

if os.environ.get("R3_TALLY_DIR"):
    # Loaded by path under its own name: the repository is not on the server's path.
    _spec = importlib.util.spec_from_file_location(
        "r3_rows_tally", Path(__file__).resolve().parents[1] / "rows_tally.py")
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["r3_rows_tally"] = _module
    _spec.loader.exec_module(_module)
    _module.install(Path(os.environ["R3_TALLY_DIR"]))
