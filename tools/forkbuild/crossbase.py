"""One source of truth across bases: each patch makes the same change on every base.

Contract: `compare_bases` takes the primary base's series and a carried base's
series, pairs patches by slug, and compares each patch by its change, not its
context: per file, the ordered list of change blocks (each maximal run of
removed and added lines inside a hunk, as text). Line numbers, context lines,
how git split the change into hunks, and the commit message do not count, so a
patch that only moved (offsets, new neighbours) is the same patch. A file whose
blocks differ is a problem unless the carried base records it in its
`intended-differences.toml` with the reason; a recorded difference that is no
longer there is a problem too, so the record stays true. Both series must hold
the same slugs in the same order, but for a primary-base patch the carried base
records as `[[absent]]` with its reason (a fix the carried release already has
upstream); a recorded absence that the carried base carries after all is a
problem.

The fork's modules (modules.py) are one copy for every base; a carried base's
own copy (`bases/<release>/vllm/...`) must be recorded as a `[[module]]` with
its reason, and must still differ from the shared copy.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import BuildError
from .series import Patch

INTENDED_NAME = "intended-differences.toml"
_HUNK = re.compile(r"^@@ -\d+(?:,(?P<old>\d+))? \+\d+(?:,(?P<new>\d+))? @@")


@dataclass(frozen=True)
class Block:
    """One contiguous change: the lines it removes and the lines it adds."""

    removed: tuple[str, ...]
    added: tuple[str, ...]

    def lines(self) -> list[str]:
        return [f"-{line}" for line in self.removed] + [f"+{line}" for line in self.added]

    def describe(self) -> str:
        first = [f"-{line}" for line in self.removed[:1]] + [f"+{line}" for line in self.added[:1]]
        return (f"{len(self.removed)} removed / {len(self.added)} added"
                + (f", starting {' '.join(repr(f) for f in first)}" if first else ""))


@dataclass(frozen=True)
class Intended:
    patch: str  # slug
    files: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Absent:
    patch: str  # slug of a primary-base patch this base does not carry
    reason: str


@dataclass(frozen=True)
class IntendedModule:
    path: str  # in vLLM's tree, as under vllm/
    reason: str


def _hunk_blocks(lines: list[str], start: int, old: int, new: int) -> tuple[list[Block], int]:
    """The blocks of the hunk whose body starts at `lines[start]`; and where it ends."""
    blocks: list[Block] = []
    removed: list[str] = []
    added: list[str] = []
    index = start

    def close() -> None:
        if removed or added:
            blocks.append(Block(tuple(removed), tuple(added)))
            removed.clear()
            added.clear()

    while (old > 0 or new > 0) and index < len(lines):
        line = lines[index]
        index += 1
        if line.startswith("\\"):  # "\ No newline at end of file"
            continue
        kind, text = line[:1], line[1:]
        if kind == "-":
            removed.append(text)
            old -= 1
        elif kind == "+":
            added.append(text)
            new -= 1
        else:  # context (a blank context line may have lost its space)
            close()
            old -= 1
            new -= 1
    close()
    return blocks, index


def change_blocks(patch: Patch) -> dict[str, list[Block]]:
    """Per file the patch touches (its new path, or old path if deleted): its blocks."""
    lines = patch.path.read_text().splitlines()
    files: dict[str, list[Block]] = {}
    current: str | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("diff --git "):
            current = line.split(" ")[-1][2:]
            files.setdefault(current, [])
            index += 1
        elif current is not None and (match := _HUNK.match(line)):
            old = int(match.group("old")) if match.group("old") is not None else 1
            new = int(match.group("new")) if match.group("new") is not None else 1
            blocks, index = _hunk_blocks(lines, index + 1, old, new)
            files[current].extend(blocks)
        else:
            index += 1
    return files


def intended_path(carried_dir: Path) -> Path:
    return carried_dir / INTENDED_NAME


def _read_record(path: Path) -> dict[str, list[dict[str, object]]]:
    """A carried base's intended-differences.toml (empty when it does not exist)."""
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise BuildError(f"{path} is not valid TOML: {exc}") from None


def load_intended(path: Path) -> list[Intended]:
    """A carried base's recorded differences (none when the file does not exist)."""
    data = _read_record(path)
    entries: list[Intended] = []
    for number, entry in enumerate(data.get("difference", []), start=1):
        where = f"{path}: [[difference]] #{number}"
        patch, files, reason = entry.get("patch"), entry.get("files"), entry.get("reason")
        if not isinstance(patch, str) or not patch:
            raise BuildError(f"{where}: field 'patch' must be the patch slug")
        if not isinstance(files, list) or not files or not all(
                isinstance(f, str) and f for f in files):
            raise BuildError(f"{where} ({patch}): field 'files' must list the files whose "
                             f"change differs")
        if not isinstance(reason, str) or not reason.strip():
            raise BuildError(f"{where} ({patch}): field 'reason' must say why the change "
                             f"differs on this base")
        entries.append(Intended(patch, tuple(files), reason.strip()))
    return entries


def load_absent(path: Path) -> list[Absent]:
    """A carried base's recorded absences (`[[absent]]`): primary-base patches it does
    not carry, each with why."""
    data = _read_record(path)
    entries: list[Absent] = []
    for number, entry in enumerate(data.get("absent", []), start=1):
        where = f"{path}: [[absent]] #{number}"
        patch, reason = entry.get("patch"), entry.get("reason")
        if not isinstance(patch, str) or not patch:
            raise BuildError(f"{where}: field 'patch' must be the slug of the primary "
                             f"base's patch this base does not carry")
        if not isinstance(reason, str) or not reason.strip():
            raise BuildError(f"{where} ({patch}): field 'reason' must say why this base "
                             f"does not need the patch")
        entries.append(Absent(patch, reason.strip()))
    return entries


def load_intended_modules(path: Path) -> list[IntendedModule]:
    """A carried base's recorded own copies of fork modules (`[[module]]`)."""
    data = _read_record(path)
    entries: list[IntendedModule] = []
    for number, entry in enumerate(data.get("module", []), start=1):
        where = f"{path}: [[module]] #{number}"
        module, reason = entry.get("path"), entry.get("reason")
        if not isinstance(module, str) or not module.startswith("vllm/"):
            raise BuildError(f"{where}: field 'path' must be the module's path in vLLM's "
                             f"tree (vllm/...)")
        if not isinstance(reason, str) or not reason.strip():
            raise BuildError(f"{where} ({module}): field 'reason' must say why this base "
                             f"needs its own copy")
        entries.append(IntendedModule(module, reason.strip()))
    return entries


def compare_modules(shared: dict[str, Path], own: dict[str, Path],
                    recorded: list[IntendedModule], carried_label: str,
                    intended_file: Path, root: Path) -> list[str]:
    """Problems with a carried base's own copies of fork modules (see module doc)."""
    problems: list[str] = []
    names = {entry.path for entry in recorded}
    for path, source in sorted(own.items()):
        if path not in names:
            problems.append(
                f"{source}: vLLM {carried_label} has its own copy of {path}; record why "
                f"in {intended_file} ([[module]] path, reason), or delete it so the base "
                f"ships the shared vllm/ copy")
        elif path in shared and (root / shared[path]).read_bytes() == (
                root / source).read_bytes():
            problems.append(
                f"{source} is the same as the shared {path}; delete it and its "
                f"[[module]] record in {intended_file}")
    for path in sorted(names - set(own)):
        problems.append(f"{intended_file}: [[module]] {path} is recorded, but vLLM "
                        f"{carried_label} has no own copy of it; remove the record")
    return problems


def _first_line_difference(ours: Block, theirs: Block) -> str:
    """Where two blocks first differ, as the diff lines on each side."""
    left, right = ours.lines(), theirs.lines()
    for index, (a, b) in enumerate(zip(left, right)):
        if a != b:
            return f"its line {index + 1}: {a!r} vs {b!r}"
    shorter, longer = (left, right) if len(left) < len(right) else (right, left)
    return (f"its line {len(shorter) + 1}: one side ends, the other has "
            f"{longer[len(shorter)]!r}")


def _first_difference(ours: list[Block], theirs: list[Block]) -> str:
    matcher = difflib.SequenceMatcher(a=ours, b=theirs, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if a0 < a1 and b0 < b1:
            return f"block {a0 + 1}, {_first_line_difference(ours[a0], theirs[b0])}"
        left = ours[a0].describe() if a0 < a1 else "nothing"
        right = theirs[b0].describe() if b0 < b1 else "nothing"
        return f"block {a0 + 1}: {left} vs {right}"
    return "same blocks"


def differing_files(primary: Patch, carried: Patch) -> dict[str, str]:
    """Files whose change differs between the two shapes of a patch -> where first."""
    ours, theirs = change_blocks(primary), change_blocks(carried)
    differing = {}
    for file in sorted(set(ours) | set(theirs)):
        a, b = ours.get(file), theirs.get(file)
        if a is None or b is None:
            differing[file] = "only on " + ("the carried base" if a is None else "the primary base")
        elif a != b:
            matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
            same = sum(size for _, _, size in matcher.get_matching_blocks())
            differing[file] = (f"{len(a) - same} of {len(a)} blocks changed, "
                               f"{len(b) - same} of {len(b)} on the other side; "
                               f"first at {_first_difference(a, b)}")
    return differing


def absence_problems(primary: list[Patch], carried: list[Patch],
                     absent: list[Absent], carried_label: str,
                     intended_file: Path) -> list[str]:
    """Recorded absences that name no primary-base patch, or a patch the carried
    base carries after all."""
    primary_slugs = {p.slug for p in primary}
    carried_slugs = {p.slug for p in carried}
    problems = []
    for entry in absent:
        if entry.patch not in primary_slugs:
            problems.append(f"{intended_file}: [[absent]] {entry.patch!r} is not a patch "
                            f"of the primary base's series; remove the record")
        elif entry.patch in carried_slugs:
            problems.append(f"{intended_file}: [[absent]] {entry.patch!r}: {carried_label} "
                            f"carries it; remove the record, or the patch")
    return problems


def compare_bases(primary: list[Patch], carried: list[Patch], primary_label: str,
                  carried_label: str, intended: list[Intended],
                  intended_file: Path, absent: list[Absent] = ()) -> list[str]:
    """Problems (empty when every patch makes the same change on both bases, apart
    from the recorded, still-present differences and absences)."""
    problems = absence_problems(primary, carried, list(absent), carried_label,
                                intended_file)
    if problems:
        return problems
    skipped = {entry.patch for entry in absent}
    primary = [p for p in primary if p.slug not in skipped]
    slugs_a, slugs_b = [p.slug for p in primary], [p.slug for p in carried]
    if slugs_a != slugs_b:
        return [f"the series differ: {primary_label} has {slugs_a}, {carried_label} has "
                f"{slugs_b}; every base carries the same patches, in the same order, with "
                f"the same subjects (or records one it does not carry as [[absent]] in "
                f"{intended_file})"]
    recorded = {(entry.patch, file) for entry in intended for file in entry.files}
    unknown = sorted({entry.patch for entry in intended} - set(slugs_a))
    problems = [f"{intended_file}: patch {slug!r} is not in the series (slugs: "
                f"{', '.join(slugs_a)})" for slug in unknown]
    for ours, theirs in zip(primary, carried):
        differing = differing_files(ours, theirs)
        for file, where in differing.items():
            if (ours.slug, file) not in recorded:
                problems.append(
                    f"{ours.slug}: {file}: the change differs between {primary_label} and "
                    f"{carried_label} ({where}). Make the same change on both bases, or "
                    f"record why it differs in {intended_file}")
        for slug, file in sorted(recorded):
            if slug == ours.slug and file not in differing:
                problems.append(
                    f"{intended_file}: {slug}: {file} is recorded as differing, but its "
                    f"change is the same on both bases (or the patch does not touch it); "
                    f"remove it from the record")
    return problems


def check_bases(root: Path) -> list[str]:
    """Compare every carried base's series with the primary base's (see module doc)."""
    from .build import base_dir, base_releases, load_series
    from .modules import common_modules, override_modules

    primary, *carried = base_releases(root)
    ours = load_series(base_dir(root, primary) / "patches")
    shared = common_modules(root)
    problems: list[str] = []
    for release in carried:
        directory = base_dir(root, release)
        record = intended_path(directory)
        problems += compare_bases(ours, load_series(directory / "patches"), primary, release,
                                  load_intended(record), record.relative_to(root),
                                  load_absent(record))
        own = {path: source.relative_to(root)
               for path, source in override_modules(root, directory).items()}
        problems += compare_modules({p: s.relative_to(root) for p, s in shared.items()},
                                    own, load_intended_modules(record), release,
                                    record.relative_to(root), root)
    return problems
