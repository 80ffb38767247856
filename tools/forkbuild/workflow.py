"""The patch workflow: a git working tree of the pinned sources, and export back to `patches/`.

    checkout  materialise upstream's Python sources (from the pinned base wheel)
              as a git repository: one `base` commit, then one commit per patch
    export    `git format-patch base..HEAD` back into patches/ and rewrite the
              series; exporting an unchanged tree reproduces the same bytes
    check     apply the series to every pinned base wheel and review each
              patch's header (subject, a body that says why)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import BuildError
from .apply import ApplyResult
from .build import BuildRequest, base_label, load_series, patch_sources, resolve
from .series import header_problems, parse_patch

BASE_TAG = "base"
# A fixed identity and date make the base commit, and so every exported
# `index` line, the same on every machine.
_BASE_ENV = {
    "GIT_AUTHOR_NAME": "vLLM upstream",
    "GIT_AUTHOR_EMAIL": "upstream@vllm.invalid",
    "GIT_COMMITTER_NAME": "vLLM upstream",
    "GIT_COMMITTER_EMAIL": "upstream@vllm.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+00:00",
}
_COMMITTER_ENV = {
    "GIT_COMMITTER_NAME": "vllm-fork checkout",
    "GIT_COMMITTER_EMAIL": "checkout@vllm-fork.invalid",
}
_SERIES_HEADER = (
    "# The fork's patch series, applied in this order to the pinned base (pins.toml).\n"
    "# Written by `python -m tools.fork export`; edit the commits, not this file.\n"
    "# ../upstream-tests/ holds a second series with its own `series` file: the\n"
    "# updates to vLLM's own tests that `python -m tools.fork upstream-tests` applies\n"
    "# to the sdist's tests/; those patches are not part of this series.\n"
)


def _git(tree: Path, *args: str, env: dict[str, str] | None = None) -> str:
    full_env = dict(os.environ)
    full_env["GIT_CEILING_DIRECTORIES"] = str(tree.resolve().parent)
    full_env.update(env or {})
    result = subprocess.run(
        ["git", "-C", str(tree), *args], env=full_env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise BuildError(f"git {' '.join(args)} failed in {tree}:\n{result.stderr.strip()}")
    return result.stdout


def _is_text(data: bytes) -> bool:
    return b"\0" not in data[:8192]


def checkout(request: BuildRequest, tree: Path, force: bool = False) -> None:
    """Create `tree` as a git repository: the base sources, then one commit per patch."""
    if tree.exists():
        if not force:
            raise BuildError(
                f"{tree} already exists; export your commits first, then pass --force "
                f"to recreate it (uncommitted work there is lost)"
            )
        shutil.rmtree(tree)
    pins, wheel, base = resolve(request)
    tree.mkdir(parents=True)
    count = 0
    with zipfile.ZipFile(base) as zf:
        for info in zf.infolist():
            name = info.filename
            if info.is_dir() or ".dist-info/" in name or name.endswith(".so"):
                continue
            data = zf.read(info)
            if _is_text(data):
                target = tree / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                count += 1
    _git(tree, "init", "-q", "-b", "main")
    _git(tree, "config", "core.autocrlf", "false")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m",
         f"{base_label(pins, wheel)}: Python sources of {wheel.filename}", env=_BASE_ENV)
    _git(tree, "tag", BASE_TAG)
    for patch in load_series(request.patches_dir):
        try:
            # The committer never reaches an exported patch; a fixed one lets
            # checkout run where git has no identity configured (CI).
            _git(tree, "am", "-q", "--keep-non-patch", "--committer-date-is-author-date",
                 str(patch.path.resolve()), env=_COMMITTER_ENV)
        except BuildError as exc:
            raise BuildError(
                f"{patch.name} does not apply in the working tree; fix it there "
                f"(git am --show-current-patch, edit, git am --continue), then export.\n{exc}"
            ) from None
    print(f"checkout: {tree}: {count} files of {wheel.filename} + "
          f"{len(read_commits(tree))} patch commits", file=sys.stderr)


def read_commits(tree: Path) -> list[str]:
    out = _git(tree, "rev-list", "--reverse", f"{BASE_TAG}..HEAD")
    return out.split()


def slug(subject: str, limit: int = 52) -> str:
    text = re.sub(r"^(\[[^\]]*\]\s*)+", "", subject).lower()
    text = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    if len(text) > limit:
        text = text[:limit].rsplit("-", 1)[0]
    return text or "patch"


def export(tree: Path, patches_dir: Path) -> list[Path]:
    """Write `base..HEAD` of `tree` into `patches_dir` as NNNN-slug.patch plus `series`."""
    if _git(tree, "status", "--porcelain", "--untracked-files=no").strip():
        raise BuildError(f"{tree} has uncommitted changes; commit or stash them before export")
    with tempfile.TemporaryDirectory() as tmp:
        _git(tree, "format-patch", "-q", "--no-signature", "--zero-commit", "--full-index",
             "--no-numbered", "--output-directory", tmp, f"{BASE_TAG}..HEAD")
        produced = sorted(Path(tmp).glob("*.patch"))
        written: list[Path] = []
        for index, path in enumerate(produced, start=1):
            name = f"{index:04d}-{slug(parse_patch(path).subject)}.patch"
            target = patches_dir / name
            data = path.read_bytes()
            if not target.exists() or target.read_bytes() != data:
                target.write_bytes(data)
            written.append(target)
    keep = {p.name for p in written}
    for stale in patches_dir.glob("*.patch"):
        if stale.name not in keep:
            stale.unlink()
    series = _SERIES_HEADER + "".join(f"{p.name}\n" for p in written)
    series_path = patches_dir / "series"
    if not series_path.exists() or series_path.read_text() != series:
        series_path.write_text(series)
    return written


def check(request: BuildRequest, all_pins: bool = True) -> list[str]:
    """Apply the series to each pinned base; return problems (empty when all is well)."""
    from .pins import load_pins

    patches = load_series(request.patches_dir)
    problems = [p for patch in patches for p in header_problems(patch)]
    pins = load_pins(request.pins_path)
    wheels = pins.wheels if all_pins else (pins.select(request.variant, request.arch),)
    for wheel in wheels:
        sub = BuildRequest(request.root, wheel.variant, wheel.arch, request.out_dir,
                           request.cache_dir, request.label, request.release)
        _, _, base = resolve(sub)
        label = base_label(pins, wheel)
        with tempfile.TemporaryDirectory(prefix="vllm-fork-check-") as tmp:
            try:
                _, results = patch_sources(base, patches, label, Path(tmp))
            except BuildError as exc:
                problems.append(str(exc))
                continue
        print(_report_line(label, results), file=sys.stderr)
    return problems


def _report_line(label: str, results: list[ApplyResult]) -> str:
    moved = [o for r in results for o in r.offsets]
    state = "applies cleanly" if not moved else f"applies with offsets ({'; '.join(moved)})"
    return f"check: {len(results)} patches: {state} to {label}"
