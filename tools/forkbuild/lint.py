"""Lint what the upstream PRs add or change, the way vLLM's pre-commit does.

Contract: `lint_prs` stages, in a temporary vLLM-shaped tree, every Python file
the PRs of one base add or change: the base release's sources of every file the
series touches with the whole series applied (from the pinned base wheel, as
the build does), plus each PR's tests and support helpers at their paths in
vLLM's tree (as `export-prs` lays them out). Beside them it puts the ruff
configuration of that release's source distribution (`pyproject.toml`, and any
nested ruff config, at the same paths), so per-file ignores and excludes apply
as upstream. It then runs `ruff check` and `ruff format --check` on those files
with the ruff version vLLM's `.pre-commit-config.yaml` pins, and returns every
finding as `path:line: CODE message` (paths in vLLM's tree; `format` findings
name the first line ruff format would change).

The source distribution is a parameter (its extracted root), so this module
never downloads anything; the command line fetches it (forkbuild.sdist).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import BuildError
from .apply import apply_series, touched_paths
from .build import extract_sources
from .prs import PrPlan, pr_files, rewrite_imports, support_module_renames
from .series import Patch

PRE_COMMIT = ".pre-commit-config.yaml"
RUFF_HOOKS = "https://github.com/astral-sh/ruff-pre-commit"
CONFIG_NAMES = ("pyproject.toml", "ruff.toml", ".ruff.toml")
# The staged tree holds only part of vllm/, so ruff cannot find every vllm module and
# would sort some imports as third-party, differently per base; in upstream's full
# tree all of vllm is first-party.
FIRST_PARTY = ("--config", 'lint.isort.known-first-party = ["vllm"]')
_REV = re.compile(r"^\s*rev:\s*['\"]?v?(?P<version>[0-9][0-9A-Za-z.]*)['\"]?\s*$")
# `pre-commit autoupdate --freeze` pins a commit and names its tag in a comment
# (vLLM 0.34.0 on): `rev: <sha>  # frozen: v0.17.2`.
_FROZEN_REV = re.compile(r"^\s*rev:\s*['\"]?[0-9a-f]{40}['\"]?\s*#\s*frozen:\s*v?"
                         r"(?P<version>[0-9][0-9A-Za-z.]*)\s*$")
_CHECK_LINE = re.compile(r"^(?P<path>[^:\s][^:]*):(?P<line>\d+):(?P<col>\d+): "
                         r"(?P<code>[A-Z]+[0-9]+|SyntaxError|invalid-syntax):? (?P<message>.*)$")
_HUNK = re.compile(r"^@@ -(?P<old>\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")


@dataclass(frozen=True, order=True)
class Finding:
    path: str  # in vLLM's tree
    line: int
    code: str  # a ruff rule, or "format"
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.code} {self.message}"


def pinned_ruff_version(source_root: Path) -> str:
    """The ruff version vLLM's pre-commit runs (the `rev` of its ruff hooks, or
    the tag a frozen `rev` names)."""
    config = source_root / PRE_COMMIT
    try:
        lines = config.read_text().splitlines()
    except FileNotFoundError:
        raise BuildError(f"{config} does not exist: is {source_root} the extracted root "
                         f"of a vLLM source distribution?") from None
    for index, line in enumerate(lines):
        if RUFF_HOOKS in line:
            for following in lines[index + 1:index + 4]:
                if match := _REV.match(following) or _FROZEN_REV.match(following):
                    return match.group("version")
    raise BuildError(f"{config}: no `rev:` for the {RUFF_HOOKS} hooks; cannot tell which "
                     f"ruff vLLM pins")


def sdist_release(source_root: Path) -> str:
    """The version a source distribution's PKG-INFO states."""
    info = source_root / "PKG-INFO"
    try:
        text = info.read_text()
    except FileNotFoundError:
        raise BuildError(f"{info} does not exist: is {source_root} the extracted root of "
                         f"a vLLM source distribution?") from None
    for line in text.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise BuildError(f"{info}: no Version field")


def find_ruff(version: str, ruff: str | None = None) -> str:
    """The ruff executable, checked to be exactly `version`."""
    candidates = [ruff] if ruff else [
        str(Path(sys.executable).parent / "ruff"), shutil.which("ruff") or ""]
    fix = (f"install it: `python -m pip install ruff=={version}` "
           f"(requirements/test.txt pins it for the test venv), or pass --ruff")
    found: list[str] = []
    for candidate in candidates:
        if not candidate or not Path(candidate).is_file():
            continue
        out = subprocess.run([candidate, "--version"], capture_output=True, text=True)
        have = out.stdout.strip().removeprefix("ruff ").strip()
        if have == version:
            return candidate
        found.append(f"{candidate} is {have or 'unrunnable'}")
    where = "; ".join(found) if found else "no ruff found next to the interpreter or on PATH"
    raise BuildError(f"vLLM pins ruff {version} ({PRE_COMMIT} of its sdist); {where}; {fix}")


def lint_targets(plan: PrPlan, series: list[Patch], root: Path,
                 modules: dict[str, Path]) -> dict[str, Path | None]:
    """Every Python file the PRs add or change, by vLLM tree path: a repo file to copy
    there (the fork's modules, tests, helpers), or None for a patched source file."""
    targets: dict[str, Path | None] = {}
    for patch in series:
        for diff in patch.files:
            if diff.new_path and diff.new_path.endswith(".py"):
                targets[diff.new_path] = None
    for dest, source in modules.items():
        if dest.endswith(".py"):
            targets[dest] = source
    for pr in plan.prs:
        for source, dest in pr_files(pr, plan, root).items():
            if dest.endswith(".py"):
                targets[dest] = root / source
    return dict(sorted(targets.items()))


def _copy_configs(source_root: Path, tree: Path) -> None:
    for name in CONFIG_NAMES:
        for config in source_root.rglob(name):
            target = tree / config.relative_to(source_root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(config, target)


def _copy_package_markers(source_root: Path, tree: Path, targets: dict[str, Path | None]
                          ) -> None:
    """Upstream's `__init__.py` of every directory above a linted file (where it has one)."""
    dirs = {parent for path in targets for parent in Path(path).parents if parent != Path(".")}
    for directory in sorted(dirs):
        marker = source_root / directory / "__init__.py"
        target = tree / directory / "__init__.py"
        if marker.is_file() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(marker, target)


def stage_tree(plan: PrPlan, series: list[Patch], modules: dict[str, Path], root: Path,
               base_wheel: Path, label: str, source_root: Path, tree: Path) -> list[str]:
    """Lay out the PRs' files and upstream's ruff config in `tree`; return the files."""
    _copy_configs(source_root, tree)
    targets = lint_targets(plan, series, root, modules)
    # Package markers let ruff see `vllm` as the first-party package it is upstream
    # (import sorting, implicit-namespace checks); the sdist has every one of them.
    extract_sources(base_wheel, touched_paths(series), tree)
    _copy_package_markers(source_root, tree, targets)
    apply_series(tree, series, label)
    renames = support_module_renames(plan)
    for dest, source in targets.items():
        if source is not None:
            (tree / dest).parent.mkdir(parents=True, exist_ok=True)
            # As export-prs writes it: support modules imported by their vLLM path.
            (tree / dest).write_text(rewrite_imports(source.read_text(), renames))
    return list(targets)


def _run(ruff: str, args: list[str], tree: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_COLOR="1")
    env.pop("RUFF_OUTPUT_FORMAT", None)
    result = subprocess.run([ruff, *args], cwd=tree, env=env, capture_output=True, text=True)
    if result.returncode not in (0, 1):
        raise BuildError(f"ruff {' '.join(args[:2])} failed (exit {result.returncode}):\n"
                         f"{result.stderr.strip() or result.stdout.strip()}")
    return result


def check_findings(output: str) -> list[Finding]:
    """`ruff check --output-format concise` lines -> findings."""
    findings = []
    for line in output.splitlines():
        if match := _CHECK_LINE.match(line):
            findings.append(Finding(match.group("path"), int(match.group("line")),
                                    match.group("code"), match.group("message").strip()))
    return findings


def format_findings(diff: str) -> list[Finding]:
    """`ruff format --diff` output -> one finding per hunk, at its first changed line."""
    findings: list[Finding] = []
    path = "?"
    old_line: int | None = None
    reported = False
    for line in diff.splitlines():
        if line.startswith("--- "):
            path = line[4:].split("\t")[0].strip()
            old_line = None
        elif line.startswith("+++ "):
            continue
        elif match := _HUNK.match(line):
            old_line, reported = int(match.group("old")), False
        elif old_line is not None and not reported and line[:1] in ("-", "+"):
            findings.append(Finding(path, old_line, "format",
                                    "ruff format would rewrite this hunk"))
            reported = True
        elif old_line is not None and line[:1] == " ":
            old_line += 1
    return findings


def run_ruff(ruff: str, files: list[str], tree: Path) -> list[Finding]:
    """`ruff check` and `ruff format --check` (as vLLM's pre-commit), over `files`."""
    if not files:
        return []
    common = ["--no-cache", "--force-exclude"]
    checked = _run(ruff, ["check", "--no-fix", "--output-format", "concise", *common,
                          *FIRST_PARTY, *files], tree)
    formatted = _run(ruff, ["format", "--diff", *common, *files], tree)
    return sorted(check_findings(checked.stdout) + format_findings(formatted.stdout))


def fix_repo_files(plan: PrPlan, series: list[Patch], modules: dict[str, Path], root: Path,
                   base_wheel: Path, label: str, source_root: Path, ruff: str) -> list[Path]:
    """Apply ruff's fixes and formatting, as upstream's config has them, to the files
    of this repository the PRs ship (the fork's modules, tests, helpers), in the staged tree where ruff
    sees them as upstream will, and copy the changed ones back. Patched vLLM sources
    are never rewritten here: fix those in the patch working tree. Returns the
    repository files that changed."""
    with tempfile.TemporaryDirectory(prefix="vllm-fork-lint-fix-") as tmp:
        tree = Path(tmp)
        stage_tree(plan, series, modules, root, base_wheel, label, source_root, tree)
        ours = {dest: source
                for dest, source in lint_targets(plan, series, root, modules).items()
                if source is not None}
        if not ours:
            return []
        _run(ruff, ["check", "--fix", "--no-cache", *FIRST_PARTY, *ours], tree)
        _run(ruff, ["format", "--no-cache", *ours], tree)
        back = {there: here for here, there in support_module_renames(plan).items()}
        changed = []
        for dest, source in ours.items():
            fixed = rewrite_imports((tree / dest).read_text(), back)
            if source.read_text() != fixed:
                source.write_text(fixed)
                changed.append(source)
        return changed


def lint_prs(plan: PrPlan, series: list[Patch], modules: dict[str, Path], root: Path,
             base_wheel: Path, label: str, source_root: Path, ruff: str) -> list[Finding]:
    """Every ruff finding on what the PRs add or change (empty when all is clean)."""
    with tempfile.TemporaryDirectory(prefix="vllm-fork-lint-") as tmp:
        tree = Path(tmp)
        files = stage_tree(plan, series, modules, root, base_wheel, label, source_root,
                           tree)
        return run_ruff(ruff, files, tree)


# Decisions about a class come from what it declares (a class attribute or method
# an out-of-tree class can set), never from its name or a probe of its attributes.
_NAME_COMPARED = re.compile(
    r"__(?:qual)?name__\s*(?:[!=]=|(?:not\s+)?in\b)\s*[\"'(\[{]"
    r"|[\"']\s*(?:[!=]=)\s*[\w.()]*__(?:qual)?name__")
# A string naming a class, compared with a value (`spec_name != "CPUOffloadingSpec"`);
# a `kv_connector` field names a registered connector, as upstream's config does.
_CLASS_LITERAL_COMPARED = re.compile(
    r"(?:[!=]=|\bnot\s+in\b|\bin\b)\s*[(\[{]?\s*[\"'][A-Z]\w*"
    r"(?:Spec|Connector|Manager|Worker|Backend|Runner)[\"']")
_CONNECTOR_FIELD = re.compile(r"kv_connector\b[\"'\]]*\s*(?:[!=]=|\bnot\s+in\b|\bin\b)")
_MAIN_GUARD = re.compile(r"^\s*if\s+__name__\s*==\s*[\"']__main__[\"']\s*:")
_PROBE = re.compile(r"\bhasattr\(|\bgetattr\([^()]*,\s*[\"'][^\"']+[\"']\s*,")
_NEW_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(?P<new>\d+)(?:,\d+)? @@")


def capability_findings(patch_name: str, text: str) -> list[Finding]:
    """The lines a patch adds to a Python file that decide by a class's name (a
    `__name__` compared with a string) or probe an attribute (`hasattr`, `getattr`
    with a default). Paths are the patched files; `code` names the rule."""
    findings: list[Finding] = []
    path: str | None = None
    line = 0
    for raw in text.splitlines():
        if raw.startswith("+++ "):
            target = raw[4:].strip()
            path = target[2:] if target.startswith("b/") else None
            continue
        if (hunk := _NEW_HUNK.match(raw)) is not None:
            line = int(hunk["new"])
            continue
        if path is None or not path.endswith(".py") or raw.startswith("--- "):
            continue
        if raw.startswith("+"):
            added = raw[1:]
            by_literal = (_CLASS_LITERAL_COMPARED.search(added) is not None
                          and _CONNECTOR_FIELD.search(added) is None)
            by_dunder = (_NAME_COMPARED.search(added) is not None
                         and _MAIN_GUARD.match(added) is None)
            if by_literal or by_dunder:
                findings.append(Finding(path, line, "class-name",
                                        f"{patch_name}: decides by a class name; declare "
                                        "a capability on the class instead"))
            elif _PROBE.search(added):
                findings.append(Finding(path, line, "attribute-probe",
                                        f"{patch_name}: probes an attribute; give the "
                                        "object what it needs in its constructor"))
            line += 1
        elif raw.startswith(" "):
            line += 1
    return findings


def module_capability_findings(name: str, path: str, text: str) -> list[Finding]:
    """`capability_findings` over a whole fork module: every line of it is added."""
    lines = text.splitlines()
    hunk = f"+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n"
    return capability_findings(name, hunk + "".join(f"+{line}\n" for line in lines))
