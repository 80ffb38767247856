"""The proxy's allocator settings take effect on glibc (the platform CI and users run)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

PROXY = Path(__file__).resolve().parents[2] / "tools" / "pdproxy"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_settings_apply_on_glibc() -> None:
    # A fresh process: mallopt changes are process-wide and would outlive this test.
    probe = (f"import sys; sys.path.insert(0, {str(PROXY)!r}); "
             "from memory import reuse_freed_memory; print(reuse_freed_memory())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "True"
