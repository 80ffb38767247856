"""Shared test setup: make the fork's tools importable (tiny model builder, CPU server)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
