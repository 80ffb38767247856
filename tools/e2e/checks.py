"""Named pass/fail checks of a harness entry point, and how they are reported."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Check:
    what: str
    ok: bool
    detail: str = ""  # printed when the check fails


def report(name: str, checks: Sequence[Check]) -> int:
    """Print one line per check and the summary `<name>: N checks, F failed`; the
    exit code: 0 only when there are checks and none failed."""
    for check in checks:
        print(f"  {'ok  ' if check.ok else 'FAIL'} {check.what}"
              + (f": {check.detail}" if check.detail and not check.ok else ""))
    failed = sum(not c.ok for c in checks)
    print(f"{name}: {len(checks)} checks, {failed} failed")
    return 0 if failed == 0 and checks else 1
