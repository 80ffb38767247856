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

The fork's modules (modules.py) are checked too: a release that ships a file at
a module's path would be shadowed by it, which the build refuses ("shadowed").
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import BuildError
from .apply import PatchDoesNotApply, apply_patch, reverse_applies, touched_paths
from .build import extract_sources
from .fetch import pip_download, sha256_file
from .series import Patch

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
    except PatchDoesNotApply as exc:
        if reverse_applies(tree, patch):
            return UPSTREAM, ()
        return CONFLICTS, (exc.location,)
    return (OFFSETS if result.offsets else CLEAN), result.offsets


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


def fetch_release(project: str, release: str, platform: str, cache: Path) -> Path:
    """Download `project==release` for `platform` into `cache` (once) with pip."""
    cache.mkdir(parents=True, exist_ok=True)
    stem = project.replace("-", "_")
    found = sorted(cache.glob(f"{stem}-{release}-*{platform}.whl"))
    if found:
        return found[0]
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        pip_download(project, release, platform, Path(tmp))
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise BuildError(f"pip downloaded {len(wheels)} wheels for {project}=={release}, "
                             "expected 1")
        target = cache / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target


def release_drift(wheel: Path, patches: list[Patch], label: str
                  ) -> tuple[list[PatchDrift], set[str]]:
    """The patches' drift, and every name the release's wheel holds."""
    with tempfile.TemporaryDirectory(prefix="vllm-fork-drift-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        names = extract_sources(wheel, touched_paths(patches), tree)
        return drift(tree, patches, label), names


def shadowed_modules(modules: dict[str, Path], names: set[str]) -> list[str]:
    """The fork's modules at a path the release ships itself."""
    return sorted(path for path in modules if path in names)


def markdown(label: str, wheel: Path, report: list[PatchDrift],
             shadowed: list[str] = ()) -> str:
    lines = [f"### {label}", "",
             f"Base: `{wheel.name}` (sha256 `{sha256_file(wheel)}`)", "",
             "| patch | in series | alone | where |", "|---|---|---|---|"]
    for row in report:
        where = "<br>".join(d.replace("|", "\\|") for d in row.details) or ""
        lines.append(f"| `{row.patch}` | {row.status} | {row.alone} | {where} |")
    counts = {s: sum(r.status == s for r in report) for s in (CLEAN, OFFSETS, CONFLICTS,
                                                              UPSTREAM)}
    lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items() if n) + "."]
    if shadowed:
        lines += ["", f"Shadowed: this release ships {len(shadowed)} of the fork's module "
                  "paths itself (the build refuses them; rename the module or move its "
                  "code into upstream's file):", ""]
        lines += [f"- `{path}`" for path in shadowed]
    return "\n".join(lines)
