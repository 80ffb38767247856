"""The series as upstream pull requests: one per capability, per base release.

Each base keeps its PR map beside its series (`patches/prs.toml` for the primary
base, `bases/<release>/patches/prs.toml` for a carried one). A map lists the PRs
in stacking order; each names its patches by slug (the patch file name without
`NNNN-` and `.patch`), so renumbering the series never breaks the map.

Each PR also names the fork modules it adds (`modules`: files of `vllm/`, see
modules.py), whole: a module belongs to exactly one PR. A PR may consist of
modules only; it then carries its description (`purpose`) and its DCO sign-off
(`signed_off_by`) itself, as a patch would.

`export_prs` writes, per PR, a directory an upstream contributor can work from:
`<name>.patch`, the PR as a maintainer receives it (one git format-patch with
its edits of upstream's files and its new modules; subject the PR title, body
the purpose and its patches' descriptions, their sign-offs), its tests and the
helpers they import at their paths in vLLM's tree, and PR.md in the shape of vLLM's pull
request template (Purpose, Test Plan, Test Result, then documentation and known
limits), citing the upstream issues and RFCs the PR answers. Every patch must
carry a DCO sign-off. The output depends only on the repository: exporting twice
gives the same bytes.

`check_prs` applies the PRs cumulatively to the base release's sources (each
PR's patches, then its modules) and, after each, runs that PR's unit tests against exactly those sources (the
installed fork's package, with every file the series touches replaced by its
state at that PR), so a PR whose tests need a later PR fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import BuildError
from .apply import apply_series, touched_paths
from .build import extract_sources
from .gitrepo import FIXED_IDENTITY, git
from .modules import place_modules
from .series import SIGNED_OFF, Patch, dco_problem, parse_patch
from .upstream_tests import test_update_paths, test_updates_dir

PLAN_NAME = "prs.toml"
_ISSUE = re.compile(r"^#[1-9][0-9]*$")
_PR_FIELDS = {"name", "title", "patches", "modules", "purpose", "signed_off_by", "tests",
              "e2e_tests", "docs", "results", "limits", "answers", "upstream"}
_REQUIRED = ("name", "title", "upstream")
# A PR's state upstream: "not opened", or its vLLM pull request number and state.
NOT_OPENED = "not opened"
_UPSTREAM = re.compile(r"^(not opened|#[1-9][0-9]* (open|merged|closed))$")


@dataclass(frozen=True)
class PullRequest:
    name: str
    title: str
    patches: tuple[str, ...]  # patch slugs, in series order
    tests: tuple[str, ...]
    e2e_tests: tuple[str, ...]
    docs: tuple[str, ...]
    results: str
    limits: str
    answers: tuple[str, ...] = ()  # upstream issues / RFCs it answers: "#55584"
    modules: tuple[str, ...] = ()  # fork modules it adds, by path in vLLM's tree
    purpose: str = ""  # why, for a PR without patches (a patch's body says it otherwise)
    signed_off_by: str = ""  # "Name <address>", for a PR without patches
    upstream: str = NOT_OPENED  # "not opened" or "#NNNNN open|merged|closed"

    @property
    def opened(self) -> bool:
        return self.upstream != NOT_OPENED


@dataclass(frozen=True)
class PrPlan:
    prs: tuple[PullRequest, ...]
    support: dict[str, str]  # helper file in this repo -> its path in vLLM's tree
    path: Path | None = None  # the map it was read from (for messages)

    @property
    def where(self) -> str:
        return str(self.path) if self.path else PLAN_NAME


def plan_path(patches_dir: Path) -> Path:
    return patches_dir / PLAN_NAME


def load_plan(path: Path, release: str | None = None) -> PrPlan:
    """Read a base's PR map; every problem names the file, the entry and the field."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        which = f"vLLM {release}" if release else "this base"
        raise BuildError(
            f"{path} does not exist: there is no PR map for {which}. Create it from "
            f"another base's map (e.g. patches/{PLAN_NAME}): one [[pr]] per capability "
            f"naming its patches by slug, with the tests that pass on {which} "
            f"(docs/upstream-prs.md)"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise BuildError(f"{path} is not valid TOML: {exc}") from None
    prs = tuple(_pull_request(entry, f"{path}: [[pr]] #{index}")
                for index, entry in enumerate(data.get("pr", []), start=1))
    if not prs:
        raise BuildError(f"{path}: no [[pr]] entries")
    support = data.get("support", {})
    if not isinstance(support, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in support.items()):
        raise BuildError(f'{path}: [support] must map "repo/path" = "vllm/tree/path" strings')
    return PrPlan(prs, dict(support), path)


def _strings(entry: dict[str, object], field: str, where: str) -> tuple[str, ...]:
    value = entry.get(field, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BuildError(f"{where}: field {field!r} must be a list of non-empty strings")
    return tuple(value)


def _pull_request(entry: dict[str, object], where: str) -> PullRequest:
    unknown = sorted(set(entry) - _PR_FIELDS)
    if unknown:
        raise BuildError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(_PR_FIELDS))}")
    for field in _REQUIRED:
        if not entry.get(field):
            hint = (f'; set upstream = "{NOT_OPENED}" until the PR is sent'
                    if field == "upstream" else "")
            raise BuildError(f"{where}: field {field!r} is missing or empty{hint}")
    name, title = entry["name"], entry["title"]
    if not isinstance(name, str) or not isinstance(title, str):
        raise BuildError(f"{where}: fields 'name' and 'title' must be strings")
    answers = _strings(entry, "answers", where)
    bad = [a for a in answers if not _ISSUE.match(a)]
    if bad:
        raise BuildError(f"{where} ({name}): answers {bad} must look like \"#55584\" "
                         f"(vLLM issue or RFC numbers)")
    upstream = entry["upstream"]
    if not isinstance(upstream, str) or not _UPSTREAM.match(upstream):
        raise BuildError(f"{where} ({name}): upstream = {upstream!r} must be "
                         f'"{NOT_OPENED}" or "#<vLLM PR number> open|merged|closed"')
    patches = _strings(entry, "patches", where)
    modules = _strings(entry, "modules", where)
    purpose = str(entry.get("purpose", "")).strip()
    signed_off_by = str(entry.get("signed_off_by", "")).strip()
    if not patches and not modules:
        raise BuildError(f"{where} ({name}): a PR needs 'patches' or 'modules'")
    if not patches and (not purpose or not SIGNED_OFF.search(
            f"Signed-off-by: {signed_off_by}")):
        raise BuildError(
            f"{where} ({name}): a PR of modules only needs 'purpose' (why, as a patch "
            f"body says it) and 'signed_off_by' (\"Name <address>\", the DCO sign-off)")
    numbered = [p for p in patches if re.match(r"^\d{4}(-|$)", p)]
    if numbered:
        raise BuildError(f"{where} ({name}): patches {numbered} name patches by number; "
                         f"use the slug (the file name without NNNN- and .patch)")
    return PullRequest(
        name=name, title=title, patches=patches,
        tests=_strings(entry, "tests", where), e2e_tests=_strings(entry, "e2e_tests", where),
        docs=_strings(entry, "docs", where), results=str(entry.get("results", "")),
        limits=str(entry.get("limits", "")), answers=answers, modules=modules,
        purpose=purpose, signed_off_by=signed_off_by, upstream=upstream)


def plan_problems(plan: PrPlan, series: list[Patch], root: Path,
                  modules: dict[str, Path]) -> list[str]:
    """Every patch in exactly one PR, in series order; every module of the base in
    exactly one PR; every listed file present."""
    problems: list[str] = []
    owners: dict[str, list[str]] = {}
    for pr in plan.prs:
        for path in pr.modules:
            owners.setdefault(path, []).append(pr.name)
    for path in sorted(set(modules) - set(owners)):
        problems.append(f"{plan.where}: no PR names the module {path} "
                        f"({modules[path].relative_to(root)}); add it to the `modules` "
                        f"of the PR that adds it")
    for path, names in sorted(owners.items()):
        if path not in modules:
            problems.append(f"{plan.where}: PR {names[0]}: module {path} does not exist "
                            f"(no {path} in this repository for this base)")
        elif len(names) > 1:
            problems.append(f"{plan.where}: module {path} is named by PRs "
                            f"{', '.join(names)}; a module belongs to the one PR that "
                            f"adds it")
    planned = [slug for pr in plan.prs for slug in pr.patches]
    slugs = [patch.slug for patch in series]
    if planned != slugs:
        missing = [s for s in slugs if s not in planned]
        extra = [s for s in planned if s not in slugs]
        problems.append(
            f"{plan.where} must list every patch once, in series order: "
            f"series {slugs}, PRs {planned}"
            + (f"; missing {missing}" if missing else "")
            + (f"; not in the series {extra}" if extra else ""))
    for pr in plan.prs:
        for listed in (*pr.tests, *pr.e2e_tests):
            if not (root / listed).is_file():
                problems.append(f"{plan.where}: PR {pr.name}: {listed} does not exist")
    for source in plan.support:
        if not (root / source).is_file():
            problems.append(f"{plan.where}: support file {source} does not exist")
    return problems


def signoff_problems(series: list[Patch]) -> list[str]:
    return [dco_problem(patch) for patch in series if not patch.signed_off]


def patches_of(pr: PullRequest, series: list[Patch]) -> list[Patch]:
    return [patch for patch in series if patch.slug in pr.patches]


def support_for(pr: PullRequest, plan: PrPlan, root: Path) -> dict[str, str]:
    """The helpers this PR's tests import (by module name), the helpers those
    import in turn, and v1's conftest."""
    tests = (*pr.tests, *pr.e2e_tests)
    chosen = {}
    if any(t.startswith("tests/v1/") for t in tests):
        chosen.update({s: t for s, t in plan.support.items() if Path(s).stem == "conftest"})
    texts = [(root / t).read_text() for t in tests]
    while texts:
        text = texts.pop()
        for source, target in plan.support.items():
            stem = Path(source).stem
            if source in chosen or stem == "conftest":
                continue
            if f"{stem} import" in text or f"import {stem}" in text:
                chosen[source] = target
                texts.append((root / source).read_text())
    return dict(sorted(chosen.items(), key=lambda item: list(plan.support).index(item[0])))


def module_of(path: str) -> str:
    """`tools/testbed/tiny_moe.py` -> `tools.testbed.tiny_moe`."""
    return path.removesuffix(".py").replace("/", ".")


def support_module_renames(plan: PrPlan) -> dict[str, str]:
    """Support modules that live elsewhere here than in vLLM's tree: this repo's
    module path -> the module path the exported files import it by."""
    return {module_of(source): module_of(target)
            for source, target in plan.support.items()
            if source.endswith(".py") and source != target}


def rewrite_imports(text: str, renames: dict[str, str]) -> str:
    """`from <here> import` / `import <here>` -> the module's path in vLLM's tree."""
    for here, there in renames.items():
        text = re.sub(rf"\b(from|import) {re.escape(here)}\b", rf"\1 {there}", text)
    return text


def pr_files(pr: PullRequest, plan: PrPlan, root: Path) -> dict[str, str]:
    """Every file the PR ships besides its patches: repo path -> path in vLLM's tree."""
    files = {test: test for test in (*pr.tests, *pr.e2e_tests)}
    files.update(support_for(pr, plan, root))
    return files


def _purpose(index: int, pr: PullRequest, plan: PrPlan, series: list[Patch],
             release: str) -> list[str]:
    lines = ["## Purpose", ""]
    if pr.answers:
        lines += ["Answers " + ", ".join(pr.answers) + ".", ""]
    lines += [f"Against vLLM {release}."]
    if index > 1:
        before = ", ".join(f"#{i} {p.name}" for i, p in enumerate(plan.prs[:index - 1], 1))
        lines += [f"Stacks on: {before} (this directory's patches apply after theirs)."]
    lines.append("")
    if pr.purpose:
        lines += [pr.purpose, ""]
    if pr.modules:
        lines += ["Adds " + ", ".join(f"`{path}`" for path in pr.modules) + ".", ""]
    for patch in patches_of(pr, series):
        lines += [f"### {patch.subject}", "", patch.description, ""]
    return lines


def _test_plan(pr: PullRequest, support: dict[str, str]) -> list[str]:
    lines = ["## Test Plan", ""]
    if pr.tests:
        lines += ["Unit tests, on CPU:", "", "```bash",
                  "pytest -m 'not e2e' \\", *(f"    {t} \\" for t in pr.tests[:-1]),
                  f"    {pr.tests[-1]}", "```", ""]
    if pr.e2e_tests:
        lines += ["End to end (starts vLLM servers on CPU):", "", "```bash",
                  *(f"pytest {t}" for t in pr.e2e_tests), "```", ""]
    if not pr.tests and not pr.e2e_tests:
        lines += ["No tests of its own.", ""]
    if support:
        lines += ["Helpers the tests import by module name: "
                  + ", ".join(f"`{target}`" for target in support.values()) + ".", ""]
    return lines


def _test_updates_section(updates: list[Patch]) -> list[str]:
    """Upstream tests whose expectation this PR changes, and why (from each update's
    message): the PR carries them (tools/forkbuild/upstream_tests.py)."""
    if not updates:
        return []
    lines = ["Changes to upstream's own tests, carried in `upstream-test-updates/`:", ""]
    for update in updates:
        files = ", ".join(f"`{diff.path}`" for diff in update.files)
        why = "\n".join(line for line in update.description.splitlines()
                        if not line.startswith("Upstream-PR:")).strip()
        lines += [f"### {update.subject}", "", f"Changes {files}.", "", why, ""]
    return lines


def pr_test_updates(pr: PullRequest, updates_dir: Path) -> list[Patch]:
    """The base's test-update patches whose `Upstream-PR:` trailer names this PR."""
    chosen = []
    for path in test_update_paths(updates_dir):
        if f"\nUpstream-PR: {pr.name}\n" in path.read_text():
            chosen.append(parse_patch(path))
    return chosen


def pr_description(index: int, pr: PullRequest, plan: PrPlan, series: list[Patch],
                   root: Path, release: str, updates: list[Patch] | None = None) -> str:
    """PR.md, in the section order of vLLM's pull request template."""
    lines = [f"# {pr.title}", ""]
    lines += _purpose(index, pr, plan, series, release)
    lines += _test_plan(pr, support_for(pr, plan, root))
    lines += _test_updates_section(updates or [])
    lines += ["## Test Result", "", pr.results or "Not measured yet.", ""]
    if pr.docs:
        lines += ["## Documentation", "",
                  "Details in this fork's " + ", ".join(f"`{d}`" for d in pr.docs) + ".", ""]
    lines += ["## Known limits", "", pr.limits or "None known.", ""]
    return "\n".join(lines)


def pr_message(pr: PullRequest, patches: list[Patch]) -> str:
    """The PR as one commit message: its title, its purpose and its patches' bodies
    (each under its subject when there are several), then every sign-off once."""
    paragraphs = [pr.purpose] if pr.purpose else []
    for patch in patches:
        paragraphs.append(patch.description if len(patches) == 1
                          else f"{patch.subject}\n\n{patch.description}")
    trailers = [f"Signed-off-by: {pr.signed_off_by}"] if pr.signed_off_by else []
    for patch in patches:
        trailers += [m.group(0).strip() for m in SIGNED_OFF.finditer(patch.body)]
    body = "\n\n".join(paragraphs)
    return f"{pr.title}\n\n{body}\n\n" + "\n".join(dict.fromkeys(trailers)) + "\n"


def _author_env(pr: PullRequest, patches: list[Patch]) -> dict[str, str]:
    """The PR's author: its first sign-off; its date: its first patch's."""
    text = patches[0].body if patches else f"Signed-off-by: {pr.signed_off_by}"
    env: dict[str, str] = {}
    if match := SIGNED_OFF.search(text):
        signer = match.group(0).removeprefix("Signed-off-by: ").strip()
        name, _, address = signer.rpartition(" <")
        env.update(GIT_AUTHOR_NAME=name, GIT_AUTHOR_EMAIL=address.rstrip(">"))
    if patches and patches[0].date:
        env["GIT_AUTHOR_DATE"] = patches[0].date
    return env


def pr_patches(plan: PrPlan, series: list[Patch], modules: dict[str, Path],
               base_wheel: Path, label: str) -> list[bytes]:
    """Each PR as the one patch a maintainer receives, in stacking order: its edits of
    upstream's files and its new modules, on upstream plus the PRs before it."""
    with tempfile.TemporaryDirectory(prefix="vllm-fork-pr-patches-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        extract_sources(base_wheel, touched_paths(series), tree)
        git(tree, "init", "-q", "-b", "main")
        git(tree, "add", "-A")
        git(tree, "commit", "-q", "--allow-empty", "-m", f"{label}: the files the PRs edit",
            env=FIXED_IDENTITY)
        written = []
        for pr in plan.prs:
            patches = patches_of(pr, series)
            apply_series(tree, patches, label)
            place_modules(tree, {path: modules[path] for path in pr.modules})
            git(tree, "add", "-A")
            git(tree, "commit", "-q", "-F", "-", stdin=pr_message(pr, patches),
                env={**FIXED_IDENTITY, **_author_env(pr, patches)})
            written.append(git(tree, "format-patch", "-1", "--stdout", "--no-signature",
                               "--zero-commit", "--full-index", "HEAD").encode())
    return written


def export_prs(plan: PrPlan, series: list[Patch], modules: dict[str, Path], root: Path,
               out_dir: Path, release: str, base_wheel: Path, label: str) -> list[Path]:
    """Write one directory per PR under `out_dir` (replaced); return them."""
    problems = plan_problems(plan, series, root, modules) + signoff_problems(series)
    if problems:
        raise BuildError("\n".join(problems))
    patches = pr_patches(plan, series, modules, base_wheel, label)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    written = []
    index_lines = [f"# Upstream pull requests against vLLM {release}", "",
                   "Stacked in this order; each directory: the PR as one patch (its edits "
                   "and new modules), tests at vLLM's paths, PR.md.", ""]
    for index, (pr, patch) in enumerate(zip(plan.prs, patches, strict=True), start=1):
        target = out_dir / f"{index:02d}-{pr.name}"
        target.mkdir(parents=True)
        (target / f"{pr.name}.patch").write_bytes(patch)
        renames = support_module_renames(plan)
        for source, dest in pr_files(pr, plan, root).items():
            (target / dest).parent.mkdir(parents=True, exist_ok=True)
            text = (root / source).read_text()
            (target / dest).write_text(rewrite_imports(text, renames)
                                       if source.endswith(".py") else text)
        # plan.path is <base>/patches/prs.toml
        updates = pr_test_updates(pr, test_updates_dir(plan.path.parent.parent))
        for update in updates:
            (target / "upstream-test-updates").mkdir(exist_ok=True)
            shutil.copyfile(update.path, target / "upstream-test-updates" / update.name)
        (target / "PR.md").write_text(
            pr_description(index, pr, plan, series, root, release, updates))
        index_lines.append(f"{index}. `{target.name}`: {pr.title} (upstream: {pr.upstream})")
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


def check_prs(plan: PrPlan, series: list[Patch], modules: dict[str, Path], root: Path,
              base_wheel: Path, label: str, installed: Path, python: str = sys.executable,
              until: int | None = None, env: dict[str, str] | None = None) -> list[str]:
    """Apply the PRs cumulatively to the base's sources; after each, run its unit tests
    there (the first `until` PRs only, when given; `env` added to the tests'
    environment). Returns problems (empty when every PR applies and its tests pass)."""
    problems = plan_problems(plan, series, root, modules) + signoff_problems(series)
    if problems:
        return problems
    paths = touched_paths(series) | set(modules)
    with tempfile.TemporaryDirectory(prefix="vllm-fork-prs-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        extract_sources(base_wheel, paths, tree)
        for index, pr in enumerate(plan.prs[:until], start=1):
            try:
                apply_series(tree, patches_of(pr, series), label)
                place_modules(tree, {path: modules[path] for path in pr.modules})
            except BuildError as exc:
                problems.append(f"PR {index} {pr.name}: {exc}")
                break
            if not pr.tests:
                print(f"check-prs: PR {index} {pr.name}: applies; no unit tests of its own",
                      file=sys.stderr, flush=True)
                continue
            overlay = _overlay(installed, tree, paths, Path(tmp) / f"overlay-{index}")
            test_env = dict(os.environ, **(env or {}), PYTHONPATH=str(overlay))
            cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not e2e",
                   *pr.tests]
            result = subprocess.run(cmd, cwd=root, env=test_env, capture_output=True,
                                    text=True)
            summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"check-prs: PR {index} {pr.name}: applies; its tests on {label} + PRs "
                  f"1-{index}: {summary}", file=sys.stderr, flush=True)
            if result.returncode != 0:
                problems.append(f"PR {index} {pr.name}: its tests fail on {label} + PRs "
                                f"1-{index}:\n{result.stdout[-3000:]}")
            shutil.rmtree(overlay)
    return problems
