"""Fetch a pinned base wheel with pip into a cache, and check its sha256.

A cached file is reused only if its hash matches the pin; a freshly downloaded
file that does not match is deleted before the build stops, so a bad download
is never reused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import BuildError
from .pins import BaseWheel

_CHUNK = 1 << 20


def default_cache_dir() -> Path:
    env = os.environ.get("VLLM_FORK_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vllm-fork" / "base-wheels"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_hash(path: Path, wheel: BaseWheel, pins_path: Path) -> None:
    actual = sha256_file(path)
    if actual != wheel.sha256:
        raise BuildError(
            f"sha256 mismatch for {path.name} ({path}):\n"
            f"  expected {wheel.sha256} (pinned in {pins_path}, {wheel.variant}/{wheel.arch})\n"
            f"  actual   {actual}\n"
            f"The file is not the pinned base release. Delete it to fetch it again, "
            f"or correct the pin if the release was deliberately changed."
        )


def _outside_build_isolation() -> dict[str, str]:
    """The environment without pip's build isolation, whose PYTHONPATH hides pip itself.

    Under `pip wheel .` this code runs in an isolated build environment: pip
    points PYTHONPATH at an overlay and sets PYTHONNOUSERSITE, so `python -m pip`
    would not find pip. The interpreter is still the caller's, whose pip we want.
    """
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONNOUSERSITE"):
        env.pop(name, None)
    return env


def pip_download(project: str, release: str, platform: str, dest: Path) -> None:
    """Download `project==release`'s wheel for `platform` into `dest` with pip."""
    # The base wheels are abi3: any CPython the release supports can install them.
    # Ask for this interpreter's version, which must satisfy Requires-Python anyway.
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:",
        "--platform", platform,
        "--implementation", "cp",
        "--python-version", python_version,
        "--dest", str(dest),
        f"{project}=={release}",
    ]
    print(f"fetch: pip {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    # pip draws its own progress bar on a terminal; its output goes straight through.
    result = subprocess.run(cmd, stdout=sys.stderr, env=_outside_build_isolation())
    if result.returncode != 0:
        raise BuildError(
            f"pip could not download {project}=={release} for {platform} "
            f"(exit {result.returncode}); see pip's message above"
        )


def fetch_base_wheel(
    wheel: BaseWheel, release: str, pins_path: Path, cache_dir: Path | None = None
) -> Path:
    """Return the path of the pinned base wheel in the cache, downloading it if needed."""
    cache = cache_dir or default_cache_dir()
    cached = cache / wheel.filename
    if cached.exists():
        print(f"fetch: using cached {cached}", file=sys.stderr, flush=True)
        check_hash(cached, wheel, pins_path)
        return cached

    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        pip_download(wheel.project, release, wheel.platform, Path(tmp))
        got = Path(tmp) / wheel.filename
        if not got.exists():
            names = ", ".join(sorted(p.name for p in Path(tmp).iterdir())) or "nothing"
            raise BuildError(
                f"pip downloaded {names}, not the pinned {wheel.filename}; "
                f"check the filename in {pins_path}"
            )
        check_hash(got, wheel, pins_path)
        shutil.move(str(got), cached)
    return cached


def cached_ruff(version: str, cache_dir: Path | None = None) -> Path:
    """A ruff executable of exactly `version`, installed with pip into the cache
    once (each base's sdist pins its own ruff: 0.14.0 for 0.31.0, 0.17.2 for
    0.34), so linting every base needs no ruff of the venv's own version."""
    target = (cache_dir or default_cache_dir()).parent / "ruff" / version
    ruff = target / "bin" / "ruff"
    if ruff.is_file():
        return ruff
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
           "--target", str(target), f"ruff=={version}"]
    print(f"fetch: pip {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    result = subprocess.run(cmd, stdout=sys.stderr, env=_outside_build_isolation())
    if result.returncode != 0 or not ruff.is_file():
        raise BuildError(f"pip could not install ruff=={version} into {target} "
                         f"(exit {result.returncode}); see pip's message above, or "
                         f"pass --ruff PATH")
    return ruff
