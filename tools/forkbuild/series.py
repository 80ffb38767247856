"""The patch series: `patches/series` and the `git format-patch` files it lists.

Parsing is deliberately small: a patch is a mail header (From, Date, Subject),
a body that explains why, and unified diffs. We parse hunk headers so that a
failure can name the exact hunk, and headers so that `check` can insist on a
subject, a why-body and a DCO sign-off as an upstream reviewer (and vLLM's DCO
check) would.

A patch's slug is its file name without the `NNNN-` prefix and `.patch`
(`workflow.slug` of its subject, as `export` names it): it names the patch
everywhere a number would break on renumbering (prs.toml, intended
differences between bases).
"""

from __future__ import annotations

import email.header
import re
from dataclasses import dataclass
from pathlib import Path

from . import BuildError

MIN_BODY_WORDS = 20
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NAME = re.compile(r"^\d{4}-[a-z0-9][a-z0-9-]*\.patch$")
_SLUG = re.compile(r"^\d{4}-(?P<slug>.+)\.patch$")
# vLLM's DCO check wants a trailer naming a person and an address.
_TRAILER = re.compile(
    r"^(Signed-off-by|Co-authored-by|Co-developed-by|Reviewed-by|Acked-by|Tested-by|"
    r"Reported-by|Suggested-by): ", re.IGNORECASE)
SIGNED_OFF = re.compile(r"^Signed-off-by: \S.* <[^<>@\s]+@[^<>\s]+>\s*$", re.MULTILINE)


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
    date: str = ""  # the mail header's Date (the author date), as written

    @property
    def slug(self) -> str:
        """The file name without `NNNN-` and `.patch`: stable across renumbering."""
        return patch_slug(self.name)

    @property
    def description(self) -> str:
        """The body without its trailers (Signed-off-by and the like): the prose."""
        lines = [line for line in self.body.splitlines() if not _TRAILER.match(line)]
        return "\n".join(lines).strip()

    @property
    def signed_off(self) -> bool:
        """Whether the message carries a DCO `Signed-off-by: Name <address>` trailer."""
        return SIGNED_OFF.search(self.body) is not None

    def hunk_at(self, file: str, line: int) -> Hunk | None:
        """The hunk of `file` whose old range starts at `line` (as git reports failures)."""
        for diff in self.files:
            if diff.path == file or diff.old_path == file:
                for hunk in diff.hunks:
                    if hunk.old_start == line:
                        return hunk
        return None


def patch_slug(name: str) -> str:
    """`0006-bound-offload-loads.patch` -> `bound-offload-loads`."""
    match = _SLUG.match(name)
    if match is None:
        raise BuildError(f"{name}: file name must look like NNNN-short-name.patch")
    return match.group("slug")


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
    date = ""
    index = 0
    in_subject = False
    while index < len(lines) and lines[index] != "":
        line = lines[index]
        if line.startswith("Date:"):
            date = line[len("Date:"):].strip()
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
        date=date,
    )


def header_problems(patch: Patch) -> list[str]:
    """What an upstream reviewer would send back before reading the diff."""
    problems: list[str] = []
    if not _NAME.match(patch.name):
        problems.append(f"{patch.name}: file name must look like NNNN-short-name.patch")
    if not patch.subject:
        problems.append(f"{patch.name}: no Subject line")
    words = len(patch.description.split())
    if words < MIN_BODY_WORDS:
        problems.append(
            f"{patch.name}: the body has {words} words; explain why the change is "
            f"needed in at least {MIN_BODY_WORDS}, as a pull-request description would"
        )
    if not patch.signed_off:
        problems.append(dco_problem(patch))
    if not patch.files:
        problems.append(f"{patch.name}: contains no diff")
    return problems


def dco_problem(patch: Patch) -> str:
    return (
        f"{patch.name}: no `Signed-off-by: Name <address>` line; vLLM accepts only "
        f"commits signed off under the DCO. Sign it in the working tree "
        f"(`git commit -s --amend` for the last commit, or `git rebase --signoff base` "
        f"for every commit), then `python -m tools.fork export`"
    )
