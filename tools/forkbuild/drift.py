"""How the series fares on another upstream release: the drift report.

For each patch, in series order, against the release's Python sources (taken
from its wheel, as the build does):

- "applies cleanly": `git apply` takes it as is;
- "applies with offsets": it applies, but hunks moved (which, and by how much);
- "conflicts": it does not apply (the file and hunk git stopped at);
- "already upstream": it does not apply, but its reverse does, so the release
  already has the change.

Patches apply cumulatively, as the build applies them; a patch that conflicts
is left out and later patches are tried without it (the report says so).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from forkbuild import BuildError
from forkbuild.apply import _describe_failure, _git_env, apply_patch, touched_paths
from forkbuild.fetch import _outside_build_isolation, sha256_file
from forkbuild.series import Patch

CLEAN = "applies cleanly"
OFFSETS = "applies with offsets"
CONFLICTS = "conflicts"
UPSTREAM = "already upstream"


@dataclass(frozen=True)
class PatchDrift:
    patch: str
    status: str  # in series order, after the patches before it
    details: tuple[str, ...] = ()
    alone: str = ""  # the status of the patch applied alone to the release


def _status(tree: Path, patch: Patch, label: str) -> tuple[str, tuple[str, ...]]:
    """Apply one patch to `tree` (in place when it applies); its status and details."""
    try:
        result = apply_patch(tree, patch, label)
    except BuildError:
        if _reverse_applies(tree, patch):
            return UPSTREAM, ()
        return CONFLICTS, _conflict(tree, patch)
    return (OFFSETS if result.offsets else CLEAN), result.offsets


def _reverse_applies(tree: Path, patch: Patch) -> bool:
    cmd = ["git", "apply", "--check", "-R", "-p1", str(patch.path.resolve())]
    return subprocess.run(cmd, cwd=tree, env=_git_env(tree),
                          capture_output=True, text=True).returncode == 0


def _conflict(tree: Path, patch: Patch) -> tuple[str, ...]:
    cmd = ["git", "apply", "--check", "--verbose", "-p1", str(patch.path.resolve())]
    result = subprocess.run(cmd, cwd=tree, env=_git_env(tree), capture_output=True, text=True)
    return (_describe_failure(patch, result.stderr).split("\n")[0],)


def drift(tree: Path, patches: list[Patch], label: str) -> list[PatchDrift]:
    """Apply `patches` in order to the sources in `tree` (modified in place); each
    patch is also tried alone on a copy of the untouched sources, which tells a
    conflict of its own from one left by an earlier patch that did not apply."""
    pristine = tree.with_name(tree.name + "-pristine")
    shutil.copytree(tree, pristine)
    report: list[PatchDrift] = []
    skipped: list[str] = []
    for patch in patches:
        alone_tree = tree.with_name(tree.name + "-alone")
        shutil.copytree(pristine, alone_tree)
        alone, _ = _status(alone_tree, patch, label)
        shutil.rmtree(alone_tree)
        status, details = _status(tree, patch, label)
        if status == CONFLICTS:
            if skipped:
                details += (f"tried without the earlier conflicting {', '.join(skipped)}",)
            skipped.append(patch.name[:4])
        report.append(PatchDrift(patch.name, status, details, alone))
    shutil.rmtree(pristine)
    return report


def extract_sources(wheel: Path, patches: list[Patch], tree: Path) -> None:
    """The wheel's copies of every file the series touches (as the build does)."""
    paths = touched_paths(patches)
    with zipfile.ZipFile(wheel) as zf:
        for path in sorted(paths & set(zf.namelist())):
            zf.extract(path, tree)


def fetch_release(project: str, release: str, platform: str, cache: Path) -> Path:
    """Download `project==release` for `platform` into `cache` (once) with pip."""
    cache.mkdir(parents=True, exist_ok=True)
    stem = project.replace("-", "_")
    found = sorted(cache.glob(f"{stem}-{release}-*{platform}.whl"))
    if found:
        return found[0]
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--platform", platform, "--implementation", "cp",
               "--python-version", python_version, "--dest", tmp, f"{project}=={release}"]
        print(f"drift: pip {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
        result = subprocess.run(cmd, stdout=sys.stderr, env=_outside_build_isolation())
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            raise BuildError(f"pip could not download {project}=={release} for {platform} "
                             f"(exit {result.returncode}); see pip's message above")
        target = cache / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target


def release_drift(wheel: Path, patches: list[Patch], label: str) -> list[PatchDrift]:
    with tempfile.TemporaryDirectory(prefix="vllm-fork-drift-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        extract_sources(wheel, patches, tree)
        return drift(tree, patches, label)


def markdown(label: str, wheel: Path, report: list[PatchDrift]) -> str:
    lines = [f"### {label}", "",
             f"Base: `{wheel.name}` (sha256 `{sha256_file(wheel)}`)", "",
             "| patch | in series | alone | where |", "|---|---|---|---|"]
    for row in report:
        where = "<br>".join(d.replace("|", "\\|") for d in row.details) or ""
        lines.append(f"| `{row.patch}` | {row.status} | {row.alone} | {where} |")
    counts = {s: sum(r.status == s for r in report) for s in (CLEAN, OFFSETS, CONFLICTS,
                                                              UPSTREAM)}
    lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items() if n) + "."]
    return "\n".join(lines)
