"""A pytest plugin that writes every test's outcome to JSON (for upstream_tests.py).

Loaded with `-p outcomes_plugin` (its directory on PYTHONPATH) and told where to
write by `$VLLM_FORK_OUTCOMES`. `$VLLM_FORK_DESELECT`, if set, names a file of node
ids (one a line) that are deselected after collection. The file maps pytest node ids to
`{"outcome": passed|failed|error|skipped, "message": <first line>, "seconds": <setup +
call + teardown>}`; a module
that fails to import is recorded under its own node id as `error`.
Works in any interpreter with pytest: it imports nothing of the fork.
"""

from __future__ import annotations

import json
import os
from typing import Any

_RESULTS: dict[str, dict[str, Any]] = {}
_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def _first_line(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        text = str(crash.message)
    elif isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        text = str(report.longrepr[2])  # a skip: (path, line, reason)
    else:
        text = str(report.longrepr or "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def _record(nodeid: str, outcome: str, message: str, seconds: float = 0.0) -> None:
    old = _RESULTS.get(nodeid)
    spent = seconds + (old["seconds"] if old is not None else 0.0)
    if old is None or _RANK[outcome] > _RANK[old["outcome"]]:
        _RESULTS[nodeid] = {"outcome": outcome, "message": message}
    _RESULTS[nodeid]["seconds"] = round(spent, 3)


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    path = os.environ.get("VLLM_FORK_DESELECT")
    if not path:
        return
    with open(path, encoding="utf-8") as handle:
        unwanted = {line.rstrip("\n") for line in handle if line.strip()}
    kept = [item for item in items if item.nodeid not in unwanted]
    dropped = [item for item in items if item.nodeid in unwanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_runtest_logreport(report: Any) -> None:
    seconds = float(getattr(report, "duration", 0.0))
    if report.when == "call":
        if report.passed:
            _record(report.nodeid, "passed", "", seconds)
        elif report.skipped:
            _record(report.nodeid, "skipped", _first_line(report), seconds)
        else:
            _record(report.nodeid, "failed", _first_line(report), seconds)
    elif report.skipped:
        _record(report.nodeid, "skipped", _first_line(report), seconds)
    elif report.failed:
        _record(report.nodeid, "error", f"{report.when}: {_first_line(report)}", seconds)
    else:
        _record(report.nodeid, "passed" if report.when == "setup" else
                _RESULTS.get(report.nodeid, {}).get("outcome", "passed"), "", seconds)


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _record(report.nodeid, "error", f"collection: {_first_line(report)}")


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("VLLM_FORK_OUTCOMES")
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(_RESULTS, handle, indent=0, sort_keys=True)
