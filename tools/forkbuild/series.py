"""The patch series: `patches/series` and the `git format-patch` files it lists.

Parsing is deliberately small: a patch is a mail header (From, Date, Subject),
a body that explains why, and unified diffs. We parse hunk headers so that a
failure can name the exact hunk, and headers so that `check` can insist on a
subject and a why-body as an upstream reviewer would.
"""

from __future__ import annotations

import email.header
import re
from dataclasses import dataclass
from pathlib import Path

from forkbuild import BuildError

MIN_BODY_WORDS = 20
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NAME = re.compile(r"^\d{4}-[a-z0-9][a-z0-9-]*\.patch$")


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_count: int
    header: str


@dataclass(frozen=True)
class FileDiff:
    old_path: str | None  # None for a new file
    new_path: str | None  # None for a deleted file
    hunks: tuple[Hunk, ...]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or "?"


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    subject: str
    body: str
    files: tuple[FileDiff, ...]

    def hunk_at(self, file: str, line: int) -> Hunk | None:
        """The hunk of `file` whose old range starts at `line` (as git reports failures)."""
        for diff in self.files:
            if diff.path == file or diff.old_path == file:
                for hunk in diff.hunks:
                    if hunk.old_start == line:
                        return hunk
        return None


def read_series(patches_dir: Path) -> list[Path]:
    """The patch files in series order; the series and the directory must agree."""
    series = patches_dir / "series"
    if not series.exists():
        raise BuildError(f"{series} does not exist")
    listed: list[str] = []
    for number, raw in enumerate(series.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not (patches_dir / line).is_file():
            raise BuildError(f"{series}:{number}: lists {line}, which does not exist")
        if line in listed:
            raise BuildError(f"{series}:{number}: lists {line} twice")
        listed.append(line)
    unlisted = sorted(
        p.name for p in patches_dir.glob("*.patch") if p.name not in listed
    )
    if unlisted:
        raise BuildError(
            f"{series} does not list {', '.join(unlisted)}; add them in order or delete them"
        )
    return [patches_dir / name for name in listed]


def _decode_subject(raw: str) -> str:
    parts = email.header.decode_header(raw)
    text = "".join(
        part.decode(enc or "utf-8") if isinstance(part, bytes) else part
        for part, enc in parts
    )
    return re.sub(r"^\[PATCH[^\]]*\]\s*", "", " ".join(text.split()))


def parse_patch(path: Path) -> Patch:
    lines = path.read_text().splitlines()
    subject_lines: list[str] = []
    index = 0
    in_subject = False
    while index < len(lines) and lines[index] != "":
        line = lines[index]
        if line.startswith("Subject:"):
            subject_lines = [line[len("Subject:"):].strip()]
            in_subject = True
        elif in_subject and line.startswith((" ", "\t")):
            subject_lines.append(line.strip())
        else:
            in_subject = False
        index += 1

    body_lines: list[str] = []
    index += 1
    while index < len(lines) and lines[index] != "---" and not lines[index].startswith("diff --git "):
        body_lines.append(lines[index])
        index += 1

    files: list[FileDiff] = []
    old_path: str | None = None
    new_path: str | None = None
    hunks: list[Hunk] = []
    started = False
    for line in lines[index:]:
        if line.startswith("diff --git "):
            if started:
                files.append(FileDiff(old_path, new_path, tuple(hunks)))
            started = True
            _, _, a_path, b_path = line.split(" ", 3)
            old_path, new_path, hunks = a_path[2:], b_path[2:], []
        elif line.startswith("new file mode"):
            old_path = None
        elif line.startswith("deleted file mode"):
            new_path = None
        elif match := _HUNK.match(line):
            count = int(match.group(2)) if match.group(2) is not None else 1
            hunks.append(Hunk(int(match.group(1)), count, line))
    if started:
        files.append(FileDiff(old_path, new_path, tuple(hunks)))

    return Patch(
        name=path.name,
        path=path,
        subject=_decode_subject(" ".join(subject_lines)),
        body="\n".join(body_lines).strip(),
        files=tuple(files),
    )


def header_problems(patch: Patch) -> list[str]:
    """What an upstream reviewer would send back before reading the diff."""
    problems: list[str] = []
    if not _NAME.match(patch.name):
        problems.append(f"{patch.name}: file name must look like NNNN-short-name.patch")
    if not patch.subject:
        problems.append(f"{patch.name}: no Subject line")
    words = len(patch.body.split())
    if words < MIN_BODY_WORDS:
        problems.append(
            f"{patch.name}: the body has {words} words; explain why the change is "
            f"needed in at least {MIN_BODY_WORDS}, as a pull-request description would"
        )
    if not patch.files:
        problems.append(f"{patch.name}: contains no diff")
    return problems
