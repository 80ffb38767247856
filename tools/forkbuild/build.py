"""Build the fork wheel: fetch, verify, patch, stamp, repack."""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import BuildError
from .apply import ApplyResult, apply_series, touched_paths
from .fetch import fetch_base_wheel
from .modules import fork_modules, require_contract
from .pins import VARIANTS, BaseWheel, Pins, load_pins
from .series import Patch, parse_patch, read_series
from .version import fork_label, fork_version
from .wheelfile import Overrides, read_metadata, repack

ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


BASES_DIR = "bases"


@dataclass(frozen=True)
class BuildRequest:
    root: Path  # the fork repository: pins.toml, patches/, bases/<release>/
    variant: str
    arch: str
    out_dir: Path
    cache_dir: Path | None = None
    label: str | None = None  # None: derive from git
    release: str | None = None  # None: the primary base (pins.toml)

    @property
    def base_dir(self) -> Path:
        return base_dir(self.root, self.release)

    @property
    def pins_path(self) -> Path:
        return self.base_dir / "pins.toml"

    @property
    def patches_dir(self) -> Path:
        return self.base_dir / "patches"

    @property
    def modules(self) -> dict[str, Path]:
        """The fork's own modules this base ships (`vllm/`, with the base's overrides)."""
        return fork_modules(self.root, self.base_dir)


def release_key(release: str) -> tuple[int, ...]:
    """`0.33.0` -> (0, 33, 0), so that 0.100.0 sorts after 0.33.0."""
    try:
        return tuple(int(part) for part in release.split("."))
    except ValueError:
        raise BuildError(f"base release {release!r} is not of the form X.Y.Z") from None


def base_releases(root: Path) -> list[str]:
    """Every base the fork carries: the primary one first, then bases/<release>/
    from oldest to newest."""
    primary = load_pins(root / "pins.toml").release
    carried = sorted(
        (path.parent.name for path in (root / BASES_DIR).glob("*/pins.toml")
         if path.parent.name != primary),
        key=release_key,
    )
    return [primary, *carried]


def newest_release(root: Path) -> str:
    """The newest vLLM release the fork carries a series for: what upstream PRs target."""
    return max(base_releases(root), key=release_key)


def base_dir(root: Path, release: str | None) -> Path:
    """Where a base's pins.toml and patches/ live: the repository root for the
    primary base, bases/<release>/ for every other one."""
    if release is None or release == load_pins(root / "pins.toml").release:
        return root
    path = root / BASES_DIR / release
    if not (path / "pins.toml").is_file():
        raise BuildError(
            f"VLLM_FORK_RELEASE={release!r}: the fork has no series for vLLM {release}; "
            f"supported base releases: {', '.join(base_releases(root))}"
        )
    return path


def request_from_env(root: Path, out_dir: Path) -> BuildRequest:
    """`VLLM_FORK_BASE` (cuda|cpu, default cuda), `VLLM_FORK_ARCH` (default: this
    machine) and `VLLM_FORK_RELEASE` (default: the primary base in pins.toml)."""
    variant = os.environ.get("VLLM_FORK_BASE", "cuda").strip().lower()
    if variant not in VARIANTS:
        raise BuildError(
            f"VLLM_FORK_BASE={variant!r} is not one of {', '.join(VARIANTS)} "
            f"(cuda: the official GPU wheel, the default; cpu: the CPU build)"
        )
    machine = platform.machine().lower()
    arch = os.environ.get("VLLM_FORK_ARCH", ARCH_ALIASES.get(machine, machine)).strip()
    release = os.environ.get("VLLM_FORK_RELEASE", "").strip() or None
    request = BuildRequest(root=root, variant=variant, arch=arch, out_dir=out_dir,
                           release=release)
    base_dir(root, release)  # an unknown release fails here, naming the variable
    return request


def base_label(pins: Pins, wheel: BaseWheel) -> str:
    return f"{wheel.project} {pins.release} ({wheel.variant}/{wheel.arch} base)"


def load_series(patches_dir: Path) -> list[Patch]:
    return [parse_patch(path) for path in read_series(patches_dir)]


def extract_sources(base_wheel: Path, paths: set[str], tree: Path) -> set[str]:
    """Extract the wheel's copies of `paths` (those it has) into `tree`; return
    every name the wheel holds."""
    with zipfile.ZipFile(base_wheel) as zf:
        present = set(zf.namelist())
        for path in sorted(paths & present):
            zf.extract(path, tree)
    return present


def patch_sources(
    base_wheel: Path, patches: list[Patch], modules: dict[str, Path], label: str,
    workdir: Path,
) -> tuple[Overrides, list[ApplyResult]]:
    """Apply the series to the files it touches and add the fork's modules; return the
    new contents and git's report. A series or a module that breaks the contract of
    `modules.py` (a patch creating a file, a module shadowing upstream's) is refused."""
    paths = touched_paths(patches)
    tree = workdir / "tree"
    tree.mkdir()
    present = extract_sources(base_wheel, paths, tree)
    require_contract(patches, modules, present, label)
    results = apply_series(tree, patches, label)
    overrides = Overrides()
    for path in sorted(paths):
        file = tree / path
        if file.is_file():
            overrides.contents[path] = file.read_bytes()
        elif path in present:
            overrides.deleted.add(path)
    for path, source in modules.items():
        overrides.contents[path] = source.read_bytes()
    return overrides, results


def resolve(request: BuildRequest) -> tuple[Pins, BaseWheel, Path]:
    pins = load_pins(request.pins_path)
    wheel = pins.select(request.variant, request.arch)
    path = fetch_base_wheel(wheel, pins.release, pins.path, request.cache_dir)
    return pins, wheel, path


def build_fork_wheel(request: BuildRequest) -> Path:
    start = time.monotonic()
    pins, wheel, base = resolve(request)
    label = request.label or fork_label(request.root)
    version = fork_version(pins.release, label, request.variant)
    patches = load_series(request.patches_dir)
    modules = request.modules
    print(f"build: vllm {version} from {base.name}, {len(patches)} patches, "
          f"{len(modules)} fork modules", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="vllm-fork-") as tmp:
        overrides, _ = patch_sources(base, patches, modules, base_label(pins, wheel),
                                     Path(tmp))
    for patch in patches:
        print(f"build: applied {patch.name}", file=sys.stderr, flush=True)
    out = repack(base, overrides, version, wheel.tag, request.out_dir)
    print(f"build: wrote {out} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return out


def base_requirements(request: BuildRequest) -> tuple[list[str], dict[str, list[str]], str | None]:
    """The base wheel's Requires-Dist (split into plain and extras) and Requires-Python."""
    from email.parser import Parser

    from packaging.requirements import Requirement

    _, _, base = resolve(request)
    meta = Parser().parsestr(read_metadata(base))
    plain: list[str] = []
    extras: dict[str, list[str]] = {}
    for raw in meta.get_all("Requires-Dist") or []:
        req = Requirement(raw)
        extra = _extra_of(req)
        if extra is None:
            plain.append(raw)
        else:
            extras.setdefault(extra, []).append(_without_extra(raw))
    return plain, extras, meta.get("Requires-Python")


def _extra_of(req: object) -> str | None:
    marker = getattr(req, "marker", None)
    if marker is None:
        return None
    text = str(marker)
    for quote in ('"', "'"):
        key = f"extra == {quote}"
        if key in text:
            return text.split(key, 1)[1].split(quote, 1)[0]
    return None


def _without_extra(raw: str) -> str:
    """`pkg>=1; python_version < "3.12" and extra == "x"` -> `pkg>=1; python_version < "3.12"`."""
    spec, _, marker = raw.partition(";")
    clauses = [c.strip() for c in marker.split(" and ") if "extra ==" not in c]
    return spec.strip() + (f"; {' and '.join(clauses)}" if clauses else "")
