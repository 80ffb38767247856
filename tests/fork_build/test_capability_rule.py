"""The patch rule of `python -m tools.fork lint` (tools/forkbuild/lint.py,
`capability_findings`): a line a patch adds to a Python file never decides by a
class's name and never probes an attribute. Decisions come from what a class
declares (a class attribute or method an out-of-tree class can set).

The planted patches below carry the lines a review found in the series (their
text as it was); the clean ones carry lines that look alike and are fine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tools.forkbuild.lint import Finding, capability_findings

ROOT = Path(__file__).resolve().parents[2]


def _patch(*added: str, path: str = "vllm/x.py", start: int = 40) -> str:
    """A one-hunk patch of `path` adding `added` after two context lines."""
    body = [" context_a = 1", " context_b = 2", *(f"+{line}" for line in added), " end = 3"]
    return "\n".join([
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001",
        "Subject: [PATCH] planted",
        "",
        "---",
        f"diff --git a/{path} b/{path}",
        f"--- a/{path}",
        f"+++ b/{path}",
        f"@@ -{start},3 +{start},{3 + len(added)} @@ def f():",
        *body,
        "",
    ])


@pytest.mark.parametrize(
    ("line", "code"),
    [
        # 0017 and 0021 as they were: an allow-list of spec names.
        ('    if spec_name != "CPUOffloadingSpec":', "class-name"),
        ('    if spec_name not in ("CPUOffloadingSpec", "TieringOffloadingSpec"):',
         "class-name"),
        ('    if type(spec).__name__ != "CPUOffloadingSpec":', "class-name"),
        ('    if "CPUOffloadingSpec" == type(spec).__qualname__:', "class-name"),
        ('    ok = cls.__name__ in ("A", "B")', "class-name"),
        # 0017 and 0022 as they were: probes of attributes.
        ('        num_chunks = getattr(self.spec, "num_chunks", 0)', "attribute-probe"),
        ('        if not getattr(transfer_config, "enable_routed_experts_transfer", '
         'False):', "attribute-probe"),
        ('        if hasattr(worker, "rows"):', "attribute-probe"),
    ],
)
def test_a_planted_line_is_found_at_its_line(line: str, code: str) -> None:
    findings = capability_findings("0099-planted.patch", _patch(line, start=40))
    # Two context lines first: the added line is line 42 of the new file.
    assert [(f.path, f.line, f.code) for f in findings] == [("vllm/x.py", 42, code)]
    assert findings[0].message.startswith("0099-planted.patch: ")


@pytest.mark.parametrize(
    "line",
    [
        'if __name__ == "__main__":',
        "logger = init_logger(__name__)",
        '    cause = f"{type(error).__name__}: {error}"',
        "    if getattr(deployment, name) is not None:",
        '    if self.kv_connector != "MultiConnector":',
        '    if chain["kv_connector"] == "MultiConnector":',
        "    slots = spec.routed_experts_rows_slots()",
    ],
)
def test_a_line_that_only_looks_alike_is_not_found(line: str) -> None:
    assert capability_findings("0099-clean.patch", _patch(line)) == []


def test_removed_lines_and_other_files_are_not_judged() -> None:
    removed = _patch("x = 1").replace(
        " context_a = 1", '-    if spec_name != "CPUOffloadingSpec":')
    assert capability_findings("p", removed) == []
    markdown = _patch('if spec_name != "CPUOffloadingSpec":', path="docs/x.md")
    assert capability_findings("p", markdown) == []


def test_line_numbers_follow_context_and_earlier_additions() -> None:
    text = _patch("a = 1", 'if hasattr(x, "y"):', start=10)
    assert capability_findings("p", text) == [
        Finding("vllm/x.py", 13, "attribute-probe",
                "p: probes an attribute; give the object what it needs in its "
                "constructor")]


SERIES_DIRS = [ROOT / "patches", *sorted(ROOT.glob("bases/*/patches"))]


@pytest.mark.parametrize("directory", SERIES_DIRS, ids=lambda d: str(d.relative_to(ROOT)))
def test_the_series_of_every_base_is_clean(directory: Path) -> None:
    patches = sorted(directory.glob("*.patch"))
    assert len(patches) >= 20
    findings = [f for p in patches for f in capability_findings(p.name, p.read_text())]
    assert findings == []
