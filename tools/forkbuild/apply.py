"""Apply the patch series to a tree of upstream sources with `git apply`.

`git apply` is exact (no fuzz) and atomic per patch. When a patch does not
apply, the error names the patch, the file and the hunk, and quotes git.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import BuildError
from .series import Patch

_FAILED_AT = re.compile(r"^error: patch failed: (.+):(\d+)$")
_CORRUPT_AT = re.compile(r"^error: corrupt patch at line (\d+)$")
_FILE_ERROR = re.compile(r"^error: ([^:]+): (.+)$")
_OFFSET = re.compile(r"^Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)\.$")


class PatchDoesNotApply(BuildError):
    """A patch git would not apply; `location` names the file and hunk."""

    def __init__(self, message: str, location: str) -> None:
        super().__init__(message)
        self.location = location


@dataclass(frozen=True)
class ApplyResult:
    patch: str
    offsets: tuple[str, ...]  # "file: hunk N moved by K lines" for hunks that needed an offset


def _git_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    # Never let git discover an enclosing repository: paths are relative to `tree`.
    env["GIT_CEILING_DIRECTORIES"] = str(tree.resolve().parent)
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return env


def _locate_line(patch: Patch, line_no: int) -> tuple[str, str]:
    """The file and hunk that git was reading when it met line `line_no` of the patch.

    A hunk that runs short makes git stop at the next file's header, so only the
    lines before `line_no` count.
    """
    file, hunk = "?", "?"
    for number, line in enumerate(patch.path.read_text().splitlines(), start=1):
        if number >= line_no:
            break
        if line.startswith("diff --git "):
            file, hunk = line.split(" ")[-1][2:], "?"
        elif line.startswith("@@ "):
            hunk = line
    return file, hunk


def _describe_failure(patch: Patch, stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    where: list[str] = []
    for line in lines:
        if match := _FAILED_AT.match(line):
            file, start = match.group(1), int(match.group(2))
            hunk = patch.hunk_at(file, start)
            where.append(f"file {file}, hunk {hunk.header if hunk else f'at line {start}'}")
        elif match := _CORRUPT_AT.match(line):
            file, hunk = _locate_line(patch, int(match.group(1)))
            where.append(
                f"file {file}, hunk {hunk} (the patch is corrupt at line {match.group(1)})"
            )
    if not where:
        for line in lines:
            if (match := _FILE_ERROR.match(line)) and match.group(1) != "patch failed":
                where.append(f"file {match.group(1)}: {match.group(2)}")
    location = "; ".join(dict.fromkeys(where)) or "(git named no file)"
    quoted = "\n".join(f"    {line}" for line in lines)
    return f"{location}\n  git apply said:\n{quoted}"


def apply_patch(tree: Path, patch: Patch, base_label: str) -> ApplyResult:
    cmd = ["git", "apply", "--verbose", "--whitespace=nowarn", "-p1", str(patch.path.resolve())]
    result = subprocess.run(
        cmd, cwd=tree, env=_git_env(tree), capture_output=True, text=True
    )
    if result.returncode != 0:
        description = _describe_failure(patch, result.stderr)
        raise PatchDoesNotApply(
            f"patch {patch.name} does not apply to {base_label}:\n  "
            f"{description}\n"
            f"Refresh it: `python -m tools.fork checkout`, fix the commit in the "
            f"working tree, then `python -m tools.fork export`.",
            location=description.split("\n")[0],
        )
    offsets: list[str] = []
    current = "?"
    for line in (result.stderr + result.stdout).splitlines():
        if line.startswith("Checking patch ") and line.endswith("..."):
            current = line.removeprefix("Checking patch ").removesuffix("...")
        elif match := _OFFSET.match(line):
            offsets.append(f"{current}: hunk {match.group(1)} moved by {match.group(3)} lines")
    return ApplyResult(patch.name, tuple(offsets))


def reverse_applies(tree: Path, patch: Patch) -> bool:
    """Whether `tree` already holds the patch's result (its reverse applies)."""
    cmd = ["git", "apply", "--check", "-R", "-p1", str(patch.path.resolve())]
    return subprocess.run(cmd, cwd=tree, env=_git_env(tree),
                          capture_output=True, text=True).returncode == 0


def apply_series(tree: Path, patches: list[Patch], base_label: str) -> list[ApplyResult]:
    return [apply_patch(tree, patch, base_label) for patch in patches]


def touched_paths(patches: list[Patch]) -> set[str]:
    """Every path any patch reads or writes, relative to the wheel root."""
    paths: set[str] = set()
    for patch in patches:
        for diff in patch.files:
            paths.update(p for p in (diff.old_path, diff.new_path) if p)
    return paths
