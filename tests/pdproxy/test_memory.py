"""The proxy's allocator settings take effect on glibc (the platform CI and users run)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the settings are glibc's"
)
def test_settings_apply_on_glibc() -> None:
    # A fresh process: mallopt changes are process-wide and would outlive this test.
    probe = "from vllm_r3_pdproxy.memory import reuse_freed_memory; print(reuse_freed_memory())"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "True"
