"""The patch workflow: a git working tree of the pinned sources, and export back to `patches/`.

    checkout  materialise upstream's Python sources (from the pinned base wheel)
              as a git repository: one `base` commit, then one commit per patch;
              the fork's modules (`vllm/`, see modules.py) join the first commit
              of the PR that adds them (prs.toml `modules`)
    export    `git format-patch base..HEAD` of the files upstream ships back into
              patches/ and rewrite the series; the files the working tree adds
              go back to `vllm/` (or to the carried base's `bases/<release>/vllm/`
              where they differ from the shared copy); exporting an unchanged tree
              reproduces the same bytes
    check     apply the series to every pinned base wheel and review each
              patch's header (subject, a body that says why)
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from . import BuildError
from .apply import ApplyResult
from .build import BuildRequest, base_label, load_series, patch_sources, resolve
from .gitrepo import FIXED_IDENTITY, git
from .modules import MODULES_DIR, common_modules, override_modules, place_modules
from .series import header_problems, parse_patch

BASE_TAG = "base"
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
    git(tree, "init", "-q", "-b", "main")
    git(tree, "config", "core.autocrlf", "false")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m",
         f"{base_label(pins, wheel)}: Python sources of {wheel.filename}", env=FIXED_IDENTITY)
    git(tree, "tag", BASE_TAG)
    _apply_with_modules(request, tree)
    _record_modules(tree, request.modules)
    print(f"checkout: {tree}: {count} files of {wheel.filename} + "
          f"{len(read_commits(tree))} patch commits", file=sys.stderr)


@dataclass
class _ModuleSteps:
    """Where checkout adds the fork's modules, keyed by the patch (slug) they follow:
    a PR's modules join its first patch's commit (`with_patch`); the modules of a PR
    without patches are a commit of their own after the PR before it (`after`; key
    None: before every patch); modules no PR names come last (`rest`)."""

    with_patch: dict[str, list[str]] = field(default_factory=dict)
    after: dict[str | None, list[tuple[list[str], str]]] = field(default_factory=dict)
    rest: list[str] = field(default_factory=list)


def _module_steps(request: BuildRequest) -> _ModuleSteps:
    from .prs import load_plan, plan_path, pr_message

    modules = request.modules
    path = plan_path(request.patches_dir)
    prs = load_plan(path).prs if path.is_file() else ()
    steps = _ModuleSteps()
    previous: str | None = None
    for pr in prs:
        paths = [path for path in pr.modules if path in modules]
        if pr.patches:
            steps.with_patch.setdefault(pr.patches[0], []).extend(paths)
            previous = pr.patches[-1]
        elif paths:
            steps.after.setdefault(previous, []).append((paths, pr_message(pr, [])))
    named = {path for pr in prs for path in pr.modules}
    steps.rest = [path for path in modules if path not in named]
    return steps


def _commit_modules(tree: Path, paths: list[str], modules: dict[str, Path],
                    message: str | None) -> None:
    """Add `paths` to the last commit (amend), or as a commit of their own."""
    place_modules(tree, {path: modules[path] for path in paths})
    git(tree, "add", "--", *paths)
    if message is None:
        date = git(tree, "log", "-1", "--format=%aI").strip()
        git(tree, "commit", "-q", "--amend", "--no-edit",
             env={**_COMMITTER_ENV, "GIT_COMMITTER_DATE": date})
    else:
        git(tree, "commit", "-q", "-F", "-", env={**FIXED_IDENTITY, **_COMMITTER_ENV},
             stdin=message)


def _apply_with_modules(request: BuildRequest, tree: Path) -> None:
    """`git am` every patch in series order, adding the fork's modules where their PR
    does (`_ModuleSteps`)."""
    modules = request.modules
    steps = _module_steps(request)
    for paths, message in steps.after.get(None, []):
        _commit_modules(tree, paths, modules, message)
    for patch in load_series(request.patches_dir):
        try:
            # The committer never reaches an exported patch; a fixed one lets
            # checkout run where git has no identity configured (CI).
            git(tree, "am", "-q", "--keep-non-patch", "--committer-date-is-author-date",
                 str(patch.path.resolve()), env=_COMMITTER_ENV)
        except BuildError as exc:
            raise BuildError(
                f"{patch.name} does not apply in the working tree; fix it there "
                f"(git am --show-current-patch, edit, git am --continue), then "
                f"export.\n{exc}") from None
        if steps.with_patch.get(patch.slug):
            _commit_modules(tree, steps.with_patch[patch.slug], modules, None)
        for paths, message in steps.after.get(patch.slug, []):
            _commit_modules(tree, paths, modules, message)
    if steps.rest:
        _commit_modules(tree, steps.rest, modules,
                        "Add the fork modules no PR names yet\n\nName each in its PR's "
                        "`modules` in prs.toml.\n")


_MODULES_RECORD = "fork-modules.json"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record_modules(tree: Path, modules: dict[str, Path]) -> None:
    """What the repository's modules were when the working tree was made (inside
    its .git, so no commit carries it): export refuses to overwrite a module that
    changed in the repository since."""
    record = {path: _digest(source) for path, source in modules.items()}
    (tree / ".git" / _MODULES_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def overwritten_modules(tree: Path, request: BuildRequest) -> list[str]:
    """The repository's modules that changed since checkout and that export would
    replace with the working tree's different version."""
    record_path = tree / ".git" / _MODULES_RECORD
    if not record_path.is_file():
        return []
    record = json.loads(record_path.read_text())
    lost = []
    for path, source in request.modules.items():
        here = tree / path
        changed = record.get(path) != _digest(source)
        if changed and here.is_file() and here.read_bytes() != source.read_bytes():
            lost.append(f"{source.relative_to(request.root)}")
    return lost


def read_commits(tree: Path) -> list[str]:
    out = git(tree, "rev-list", "--reverse", f"{BASE_TAG}..HEAD")
    return out.split()


def slug(subject: str, limit: int = 52) -> str:
    text = re.sub(r"^(\[[^\]]*\]\s*)+", "", subject).lower()
    text = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    if len(text) > limit:
        text = text[:limit].rsplit("-", 1)[0]
    return text or "patch"


def added_paths(tree: Path) -> list[str]:
    """Every file a commit after `base` adds: the fork's modules, as the tree has them."""
    out = git(tree, "log", "--format=", "--name-only", "--diff-filter=A", f"{BASE_TAG}..HEAD")
    return sorted({line for line in out.splitlines() if line})


def export(tree: Path, request: BuildRequest) -> list[Path]:
    """Write `base..HEAD` of `tree` into the base's patches/ as NNNN-slug.patch plus
    `series` (edits of upstream's files only), and the files the tree adds into the
    fork's `vllm/` (`export_modules`)."""
    patches_dir = request.patches_dir
    if git(tree, "status", "--porcelain", "--untracked-files=no").strip():
        raise BuildError(f"{tree} has uncommitted changes; commit or stash them before export")
    lost = overwritten_modules(tree, request)
    if lost:
        raise BuildError(
            f"{', '.join(lost)} changed in this repository since {tree} was checked "
            f"out, and the working tree has another version: export would overwrite "
            f"the change. Copy it into the working tree and commit it there (or drop "
            f"it), then export again")
    added = added_paths(tree)
    commits = read_commits(tree)
    edits = [c for c in commits if set(_changed(tree, c)) - set(added)]
    with tempfile.TemporaryDirectory() as tmp:
        git(tree, "format-patch", "-q", "--no-signature", "--zero-commit", "--full-index",
             "--no-numbered", "--output-directory", tmp, f"{BASE_TAG}..HEAD",
             "--", ".", *(f":(exclude){path}" for path in added))
        produced = sorted(Path(tmp).glob("*.patch"))
        if len(produced) != len(edits):
            raise BuildError(f"format-patch wrote {len(produced)} patches for "
                             f"{len(edits)} commits that edit upstream's files")
        written: list[Path] = []
        for index, path in enumerate(produced, start=1):
            name = f"{index:04d}-{slug(parse_patch(path).subject)}.patch"
            target = patches_dir / name
            data = path.read_bytes()
            if not target.exists() or target.read_bytes() != data:
                target.write_bytes(data)
            written.append(target)
    for commit in commits:
        if commit not in edits:
            subject = git(tree, "log", "-1", "--format=%s", commit).strip()
            print(f"export: {subject!r} changes only the fork's modules: no patch; its "
                  f"files go to {MODULES_DIR}/", file=sys.stderr)
    keep = {p.name for p in written}
    for stale in patches_dir.glob("*.patch"):
        if stale.name not in keep:
            stale.unlink()
    series = _SERIES_HEADER + "".join(f"{p.name}\n" for p in written)
    series_path = patches_dir / "series"
    if not series_path.exists() or series_path.read_text() != series:
        series_path.write_text(series)
    export_modules(tree, request, added)
    return written


def _changed(tree: Path, commit: str) -> list[str]:
    out = git(tree, "diff-tree", "--no-commit-id", "--name-only", "-r", commit)
    return out.split()


def export_modules(tree: Path, request: BuildRequest, added: list[str]) -> None:
    """The working tree's added files back into this repository: the primary base
    writes the shared `vllm/`; a carried base writes `bases/<release>/vllm/` only
    where its file differs from the shared one (and drops overrides that no longer
    differ). Says every module it changes, and which are shared by every base."""
    root = request.root
    present = {path for path in added if (tree / path).is_file()}
    shared = common_modules(root)
    overrides = override_modules(root, request.base_dir)
    carried = request.base_dir.resolve() != root.resolve()
    for path in sorted(present):
        data = (tree / path).read_bytes()
        common = shared.get(path)
        if carried and common is not None and common.read_bytes() == data:
            if path in overrides:
                overrides[path].unlink()
                print(f"export: {path}: same as the shared copy; removed "
                      f"{overrides[path].relative_to(root)}", file=sys.stderr)
            continue
        target = (request.base_dir if carried else root) / path
        if target.is_file() and target.read_bytes() == data:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        note = ("this base's own copy: record why in intended-differences.toml "
                "([[module]])" if carried else "shared by every base")
        print(f"export: wrote {target.relative_to(root)} ({note})", file=sys.stderr)
    for path, source in sorted((overrides if carried else shared).items()):
        if path not in present:
            source.unlink()
            print(f"export: removed {source.relative_to(root)}: the working tree no "
                  f"longer has {path}", file=sys.stderr)
    if carried:
        for path in sorted(set(shared) - present):
            print(f"export: warning: the working tree has no {path}, but "
                  f"{shared[path].relative_to(root)} is shared by every base; delete it "
                  f"there if no base needs it", file=sys.stderr)


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
                _, results = patch_sources(base, patches, sub.modules, label, Path(tmp))
            except BuildError as exc:
                problems.append(str(exc))
                continue
        print(_report_line(label, results), file=sys.stderr)
    return problems


def _report_line(label: str, results: list[ApplyResult]) -> str:
    moved = [o for r in results for o in r.offsets]
    state = "applies cleanly" if not moved else f"applies with offsets ({'; '.join(moved)})"
    return f"check: {len(results)} patches: {state} to {label}"
