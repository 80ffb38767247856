"""The series as upstream PRs (patches/prs.toml, tools/forkbuild/prs.py): the plan
covers the series, the export is reproducible, and each PR applies to the pinned
release's pristine sources on top of the PRs before it, with its unit tests passing
there. The negative control assigns a test to a PR before the patch it needs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from fakefork import ROOT
from forkbuild.build import base_label, load_series, resolve, request_from_env
from forkbuild.prs import check_prs, export_prs, load_plan, plan_problems

PATCHES = ROOT / "patches"


@pytest.fixture(scope="module")
def plan_and_series():
    return load_plan(PATCHES / "prs.toml"), load_series(PATCHES)


def _tree_bytes(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def test_the_plan_covers_the_series_in_order(plan_and_series) -> None:
    plan, series = plan_and_series
    assert plan_problems(plan, series, ROOT) == []
    assert [n for pr in plan.prs for n in pr.patches] == [p.name[:4] for p in series]


def test_a_patch_left_out_or_out_of_order_is_reported(plan_and_series) -> None:
    plan, series = plan_and_series
    swapped = dataclasses.replace(plan, prs=(plan.prs[1], plan.prs[0], *plan.prs[2:]))
    [problem] = plan_problems(swapped, series, ROOT)
    assert problem.startswith("patches/prs.toml must list every patch once, in series order")
    dropped = dataclasses.replace(plan, prs=plan.prs[:-1])
    assert "; missing ['0010']" in plan_problems(dropped, series, ROOT)[0]


def test_export_is_reproducible_and_complete(plan_and_series, tmp_path: Path) -> None:
    plan, series = plan_and_series
    first = export_prs(plan, series, ROOT, tmp_path / "a")
    export_prs(plan, series, ROOT, tmp_path / "b")
    assert _tree_bytes(tmp_path / "a") == _tree_bytes(tmp_path / "b")
    exported = [p.name for d in first for p in sorted((d / "patches").iterdir())]
    assert exported == [p.name for p in series]
    offload = next(d for d in first if d.name.endswith("routed-experts-kv-offload"))
    text = (offload / "PR.md").read_text()
    assert text.startswith("# [Core][KV Connector] Routed experts with KV offload")
    assert "Stacks on: #1 cpu-model-runner-v2, #2 routed-experts-nixl-pd" in text
    assert "640 / 640 = 1.00" in text
    assert (offload / "tests/v1/core/test_aux_output_loaded_block_cut.py").is_file()
    assert (offload / "tests/v1/aux_scheduler_utils.py").is_file()  # a helper it imports


def _check(plan, series, until: int | None = None) -> list[str]:
    request = request_from_env(ROOT, ROOT / "dist")
    request = dataclasses.replace(request, variant="cpu")
    pins, wheel, base = resolve(request)
    installed = Path(importlib.util.find_spec("vllm").origin).parent
    return check_prs(plan, series, ROOT, base, base_label(pins, wheel), installed,
                     sys.executable, until)


def test_each_pr_applies_and_passes_its_tests_on_pristine_sources(plan_and_series) -> None:
    plan, series = plan_and_series
    assert _check(plan, series) == []


def test_a_test_needing_a_later_pr_fails_the_check(plan_and_series) -> None:
    """Negative control: the offload gate's test filed under the P/D PR."""
    plan, series = plan_and_series
    pd = dataclasses.replace(plan.prs[1], tests=("tests/config/test_aux_output_offload_gate.py",))
    misfiled = dataclasses.replace(plan, prs=(plan.prs[0], pd, *plan.prs[2:]))
    problems = _check(misfiled, series, until=2)
    assert len(problems) == 1
    assert problems[0].startswith("PR 2 routed-experts-nixl-pd: its tests fail on upstream "
                                  "+ PRs 1-2")
