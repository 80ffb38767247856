"""The series as upstream pull requests: one per capability (patches/prs.toml).

`export_prs` writes, per PR, a directory an upstream contributor can work from:
its patches (git format-patch, as in patches/), its tests and the helpers they
import at their paths in vLLM's tree, and PR.md (problem and fix from the
patch headers, tests, results from the harness and benchmarks, known limits,
what it stacks on). The output depends only on the repository: exporting twice
gives the same bytes.

`check_prs` applies the PRs cumulatively to the pinned release's sources and,
after each, runs that PR's unit tests against exactly those sources (the
installed fork's package, with every file the series touches replaced by its
state at that PR), so a PR whose tests need a later PR fails here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from forkbuild import BuildError
from forkbuild.apply import apply_series, touched_paths
from forkbuild.build import extract_sources
from forkbuild.series import Patch


@dataclass(frozen=True)
class PullRequest:
    name: str
    title: str
    patches: tuple[str, ...]  # the series' 4-digit prefixes
    tests: tuple[str, ...]
    e2e_tests: tuple[str, ...]
    docs: tuple[str, ...]
    results: str
    limits: str


@dataclass(frozen=True)
class PrPlan:
    prs: tuple[PullRequest, ...]
    support: dict[str, str]  # helper file in this repo -> its path in vLLM's tree


def load_plan(path: Path) -> PrPlan:
    data = tomllib.loads(path.read_text())
    prs = tuple(
        PullRequest(
            name=entry["name"], title=entry["title"], patches=tuple(entry["patches"]),
            tests=tuple(entry.get("tests", ())), e2e_tests=tuple(entry.get("e2e_tests", ())),
            docs=tuple(entry.get("docs", ())), results=entry.get("results", ""),
            limits=entry.get("limits", ""))
        for entry in data.get("pr", [])
    )
    return PrPlan(prs, dict(data.get("support", {})))


def plan_problems(plan: PrPlan, series: list[Patch], root: Path) -> list[str]:
    """Every patch in exactly one PR, in series order; every listed file present."""
    problems: list[str] = []
    planned = [number for pr in plan.prs for number in pr.patches]
    numbers = [patch.name[:4] for patch in series]
    if planned != numbers:
        missing = [n for n in numbers if n not in planned]
        extra = [n for n in planned if n not in numbers]
        problems.append(
            "patches/prs.toml must list every patch once, in series order: "
            f"series {numbers}, PRs {planned}"
            + (f"; missing {missing}" if missing else "")
            + (f"; not in the series {extra}" if extra else ""))
    for pr in plan.prs:
        for listed in (*pr.tests, *pr.e2e_tests):
            if not (root / listed).is_file():
                problems.append(f"PR {pr.name}: {listed} does not exist")
    for source in plan.support:
        if not (root / source).is_file():
            problems.append(f"support file {source} does not exist")
    return problems


def _patches_of(pr: PullRequest, series: list[Patch]) -> list[Patch]:
    return [patch for patch in series if patch.name[:4] in pr.patches]


def _support_for(pr: PullRequest, plan: PrPlan, root: Path) -> dict[str, str]:
    """The helpers this PR's tests import (by module name), and v1's conftest."""
    texts = [(root / t).read_text() for t in (*pr.tests, *pr.e2e_tests)]
    chosen = {}
    for source, target in plan.support.items():
        stem = Path(source).stem
        uses = (any(t.startswith("tests/v1/") for t in (*pr.tests, *pr.e2e_tests))
                if stem == "conftest" else any(f"{stem} import" in text or f"import {stem}"
                                                in text for text in texts))
        if uses:
            chosen[source] = target
    return chosen


def pr_description(index: int, pr: PullRequest, plan: PrPlan, series: list[Patch],
                   root: Path) -> str:
    patches = _patches_of(pr, series)
    lines = [f"# {pr.title}", ""]
    if index > 1:
        before = ", ".join(f"#{i} {p.name}" for i, p in enumerate(plan.prs[:index - 1], 1))
        lines += [f"Stacks on: {before} (this directory's patches apply after theirs).", ""]
    lines += ["## Problem and fix", ""]
    for patch in patches:
        lines += [f"### {patch.subject}", "", patch.body.strip(), ""]
    lines += ["## Tests", ""]
    support = _support_for(pr, plan, root)
    for test in pr.tests:
        lines.append(f"- `{test}` (unit, CPU)")
    for test in pr.e2e_tests:
        lines.append(f"- `{test}` (starts vLLM servers on CPU)")
    if not pr.tests and not pr.e2e_tests:
        lines.append("- none of its own")
    if support:
        lines += ["", "Helpers the tests import by module name: "
                  + ", ".join(f"`{target}`" for target in support.values()) + "."]
    lines += ["", "## How it was tested, and the numbers", "", pr.results, ""]
    if pr.docs:
        lines += ["Details in this fork's " + ", ".join(f"`{d}`" for d in pr.docs) + ".", ""]
    lines += ["## Known limits", "", pr.limits or "None known.", ""]
    return "\n".join(lines)


def export_prs(plan: PrPlan, series: list[Patch], root: Path, out_dir: Path) -> list[Path]:
    """Write one directory per PR under `out_dir` (replaced); return them."""
    problems = plan_problems(plan, series, root)
    if problems:
        raise BuildError("\n".join(problems))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    written = []
    index_lines = ["# Upstream pull requests", "",
                   "Stacked in this order; each directory: patches/, tests at vLLM's paths, "
                   "PR.md.", ""]
    for index, pr in enumerate(plan.prs, start=1):
        target = out_dir / f"{index:02d}-{pr.name}"
        (target / "patches").mkdir(parents=True)
        for patch in _patches_of(pr, series):
            shutil.copyfile(patch.path, target / "patches" / patch.name)
        for test in (*pr.tests, *pr.e2e_tests):
            (target / test).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / test, target / test)
        for source, dest in _support_for(pr, plan, root).items():
            (target / dest).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / source, target / dest)
        (target / "PR.md").write_text(pr_description(index, pr, plan, series, root))
        index_lines.append(f"{index}. `{target.name}`: {pr.title}")
        written.append(target)
    (out_dir / "README.md").write_text("\n".join(index_lines) + "\n")
    return written


def _overlay(installed: Path, tree: Path, paths: set[str], dest: Path) -> Path:
    """The installed `vllm` package with every series-touched file at `tree`'s state."""
    package = dest / "vllm"
    dest.mkdir(parents=True)
    subprocess.run(["cp", "-rs", str(installed), str(package)], check=True)
    for path in sorted(paths):
        rel = Path(path).relative_to("vllm")
        target = package / rel
        if target.exists() or target.is_symlink():
            target.unlink()
        source = tree / path
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    return dest


def check_prs(plan: PrPlan, series: list[Patch], root: Path, base_wheel: Path, label: str,
              installed: Path, python: str = sys.executable,
              until: int | None = None) -> list[str]:
    """Apply the PRs cumulatively to the base's sources; after each, run its unit tests
    there (the first `until` PRs only, when given). Returns problems (empty when every
    PR applies and its tests pass)."""
    problems = plan_problems(plan, series, root)
    if problems:
        return problems
    paths = touched_paths(series)
    with tempfile.TemporaryDirectory(prefix="vllm-fork-prs-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        extract_sources(base_wheel, paths, tree)
        for index, pr in enumerate(plan.prs[:until], start=1):
            try:
                apply_series(tree, _patches_of(pr, series), label)
            except BuildError as exc:
                problems.append(f"PR {index} {pr.name}: {exc}")
                break
            if not pr.tests:
                print(f"check-prs: PR {index} {pr.name}: applies; no unit tests of its own",
                      file=sys.stderr, flush=True)
                continue
            overlay = _overlay(installed, tree, paths, Path(tmp) / f"overlay-{index}")
            env = dict(os.environ, PYTHONPATH=str(overlay))
            cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not e2e",
                   *pr.tests]
            result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
            summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"check-prs: PR {index} {pr.name}: applies; its tests on upstream + PRs "
                  f"1-{index}: {summary}", file=sys.stderr, flush=True)
            if result.returncode != 0:
                problems.append(f"PR {index} {pr.name}: its tests fail on upstream + PRs "
                                f"1-{index}:\n{result.stdout[-3000:]}")
            shutil.rmtree(overlay)
    return problems
