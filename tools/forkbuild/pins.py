"""The pin file: which upstream release and which exact base wheels we build from."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import BuildError

VARIANTS = ("cuda", "cpu")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class BaseWheel:
    """One pinned base wheel: the file the registry serves and its sha256."""

    variant: str
    arch: str
    project: str
    filename: str
    sha256: str

    @property
    def tag(self) -> str:
        """The wheel's compatibility tag, from its file name (`cp38-abi3-manylinux_2_28_x86_64`)."""
        stem = self.filename.removesuffix(".whl")
        return "-".join(stem.split("-")[-3:])

    @property
    def platform(self) -> str:
        return self.tag.split("-")[-1]


@dataclass(frozen=True)
class Sdist:
    """The pinned source distribution of the release (its tests run against the fork)."""

    project: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class Pins:
    release: str
    upstream_commit: str
    wheels: tuple[BaseWheel, ...]
    path: Path
    sdist: Sdist | None = None

    def select(self, variant: str, arch: str) -> BaseWheel:
        for wheel in self.wheels:
            if wheel.variant == variant and wheel.arch == arch:
                return wheel
        have = ", ".join(f"{w.variant}/{w.arch}" for w in self.wheels)
        raise BuildError(
            f"{self.path}: no base wheel pinned for variant={variant!r} arch={arch!r}; "
            f"pinned: {have}. Pick one of those (VLLM_FORK_BASE, VLLM_FORK_ARCH) "
            f"or add a [[wheel]] entry with its sha256."
        )


def load_pins(path: Path) -> Pins:
    """Read and validate `pins.toml`; every problem names the field and the entry."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise BuildError(f"pin file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise BuildError(f"pin file {path} is not valid TOML: {exc}") from None

    base = data.get("base")
    if not isinstance(base, dict) or not isinstance(base.get("release"), str):
        raise BuildError(f'{path}: [base] must set release = "X.Y.Z"')
    release = base["release"]

    wheels: list[BaseWheel] = []
    for index, entry in enumerate(data.get("wheel", [])):
        where = f"{path}: [[wheel]] #{index + 1}"
        fields = {}
        for field in ("variant", "arch", "project", "filename", "sha256"):
            value = entry.get(field)
            if not isinstance(value, str) or not value:
                raise BuildError(f"{where}: field {field!r} is missing or empty")
            fields[field] = value
        if fields["variant"] not in VARIANTS:
            raise BuildError(
                f"{where}: variant {fields['variant']!r} is not one of {', '.join(VARIANTS)}"
            )
        if not _SHA256.match(fields["sha256"]):
            raise BuildError(
                f"{where}: sha256 must be 64 lowercase hex digits, got {fields['sha256']!r}"
            )
        dist = fields["project"].replace("-", "_")
        if not fields["filename"].startswith(f"{dist}-{release}-"):
            raise BuildError(
                f"{where}: filename {fields['filename']!r} is not a {fields['project']} "
                f"{release} wheel; expected it to start with {dist}-{release}-"
            )
        wheels.append(BaseWheel(**fields))
    if not wheels:
        raise BuildError(f"{path}: no [[wheel]] entries")
    return Pins(
        release=release,
        upstream_commit=str(base.get("upstream_commit", "")),
        wheels=tuple(wheels),
        path=path,
        sdist=load_sdist(data.get("sdist"), release, path),
    )


def load_sdist(entry: object, release: str, path: Path) -> Sdist | None:
    """The optional `[sdist]` table: filename and sha256 of `<project>-<release>.tar.gz`."""
    if entry is None:
        return None
    where = f"{path}: [sdist]"
    if not isinstance(entry, dict):
        raise BuildError(f"{where} must be a table with filename and sha256")
    project = entry.get("project", "vllm")
    if not isinstance(project, str) or not project:
        raise BuildError(f"{where}: field 'project' must be a non-empty string (default vllm)")
    fields = {}
    for field in ("filename", "sha256"):
        value = entry.get(field)
        if not isinstance(value, str) or not value:
            raise BuildError(f"{where}: field {field!r} is missing or empty")
        fields[field] = value
    if not _SHA256.match(fields["sha256"]):
        raise BuildError(
            f"{where}: sha256 must be 64 lowercase hex digits, got {fields['sha256']!r}"
        )
    expected = f"{project.replace('-', '_')}-{release}.tar.gz"
    if fields["filename"] != expected:
        raise BuildError(
            f"{where}: filename {fields['filename']!r} is not the {project} {release} "
            f"source release; expected {expected!r}"
        )
    return Sdist(project=project, **fields)
