"""Fetch a base's pinned vLLM source distribution with pip, check it, extract it.

Contract: `fetch_sdist(request)` returns the extracted source root (the
directory holding `pyproject.toml` and `tests/`) of the sdist pinned in the
base's `pins.toml` `[sdist]` table. The tarball and its extraction live in the
base-wheel cache (`$VLLM_FORK_CACHE`, default `~/.cache/vllm-fork/base-wheels`).
A tarball is used only if its sha256 equals the pin; one that does not (a fresh
download or a cached file) is deleted before the error is raised, so it is never
reused. Nothing of the sdist is ever written into the repository.

How pip is made to download an sdist it cannot build
----------------------------------------------------
`pip download` saves an sdist only after it has prepared the sdist's metadata,
which for vLLM runs vLLM's `setup.py` (it imports torch, setuptools-rust, and
looks for a compiler toolchain), so it fails on a machine without vLLM's build
dependencies. The metadata pip needs (name and version) is already in the sdist:
every sdist carries its core metadata as `PKG-INFO` at its root. So pip runs
with `--no-build-isolation` (the build backend is imported from the calling
environment, not installed) and `PYTHONPATH` pointing at a generated stand-in
for the backend vLLM's `pyproject.toml` names (`setuptools.build_meta`). The
stand-in implements only the PEP 517 metadata hook and copies `PKG-INFO` into a
`.dist-info/METADATA`; pip then checks name and version against the request and
saves the untouched tarball. No code of the sdist runs, nothing is built, and
pip remains the only thing that talks to the registry (index, credentials,
proxies and certificates as the user configured them). The stand-in exists only
in a temporary directory for the one pip process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from . import BuildError
from .build import BuildRequest
from .fetch import default_cache_dir, sha256_file
from .pins import Pins, Sdist, load_pins

# The build backend vLLM's pyproject.toml names, and the stand-in pip imports instead.
BACKEND_PACKAGE = "setuptools"
_BACKEND_SOURCE = '''"""Stand-in PEP 517 backend (tools/forkbuild/sdist.py): metadata from PKG-INFO only."""
import os


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    fields = {}
    with open("PKG-INFO", encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    name = fields["Name"].replace("-", "_")
    info = f"{name}-{fields['Version']}.dist-info"
    os.makedirs(os.path.join(metadata_directory, info), exist_ok=True)
    with open(os.path.join(metadata_directory, info, "METADATA"), "w", encoding="utf-8") as out:
        out.write(f"Metadata-Version: 2.1\\nName: {fields['Name']}\\n"
                  f"Version: {fields['Version']}\\n")
    return info


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("the sdist fetcher's stand-in backend never builds")
'''
EXTRACTED_MARK = ".sdist-sha256"


def _pins_with_sdist(request: BuildRequest) -> tuple[Pins, Sdist]:
    pins = load_pins(request.pins_path)
    if pins.sdist is None:
        raise BuildError(
            f"{pins.path}: no [sdist] table; add one with filename = "
            f'"vllm-{pins.release}.tar.gz" and its sha256 to run upstream\'s tests '
            f"(tools/forkbuild/sdist.py)"
        )
    return pins, pins.sdist


def check_sdist_hash(path: Path, sdist: Sdist, pins_path: Path) -> None:
    """Raise (after deleting `path`) unless its sha256 is the pinned one."""
    actual = sha256_file(path)
    if actual == sdist.sha256:
        return
    path.unlink()
    raise BuildError(
        f"sha256 mismatch for {path.name} ({path}):\n"
        f"  expected {sdist.sha256} (pinned in {pins_path}, [sdist] sha256)\n"
        f"  actual   {actual}\n"
        f"The file is not the pinned source release and was deleted; the next run "
        f"fetches it again. If the release was deliberately changed, correct the pin."
    )


def write_backend_stand_in(directory: Path) -> Path:
    """Write the metadata-only backend package into `directory`; return `directory`."""
    package = directory / BACKEND_PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""Stand-in for the sdist fetcher only."""\n')
    (package / "build_meta.py").write_text(_BACKEND_SOURCE)
    return directory


def _pip_env(stand_in: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    env["PYTHONPATH"] = str(stand_in)
    return env


def pip_download_sdist(sdist: Sdist, release: str, dest: Path, python: str = sys.executable) -> None:
    """Download `project==release`'s sdist into `dest` with pip (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="vllm-fork-backend-") as tmp:
        stand_in = write_backend_stand_in(Path(tmp))
        cmd = [python, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
               "--no-binary", sdist.project, "--dest", str(dest),
               f"{sdist.project}=={release}"]
        print(f"sdist: pip {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
        result = subprocess.run(cmd, stdout=sys.stderr, env=_pip_env(stand_in))
    if result.returncode != 0:
        raise BuildError(
            f"pip could not download the {sdist.project}=={release} sdist "
            f"(exit {result.returncode}); see pip's message above"
        )


def cached_sdist(request: BuildRequest) -> tuple[Pins, Sdist, Path]:
    """The pinned tarball in the cache, downloaded if missing; hash-checked either way."""
    pins, sdist = _pins_with_sdist(request)
    cache = request.cache_dir or default_cache_dir()
    cached = cache / sdist.filename
    if cached.exists():
        check_sdist_hash(cached, sdist, pins.path)
        return pins, sdist, cached
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        pip_download_sdist(sdist, pins.release, Path(tmp))
        got = Path(tmp) / sdist.filename
        if not got.exists():
            names = ", ".join(sorted(p.name for p in Path(tmp).iterdir())) or "nothing"
            raise BuildError(
                f"pip downloaded {names}, not the pinned {sdist.filename}; "
                f"check [sdist] filename in {pins.path}"
            )
        check_sdist_hash(got, sdist, pins.path)
        shutil.move(str(got), cached)
    return pins, sdist, cached


def _source_root(extracted: Path, sdist: Sdist) -> Path:
    root = extracted / sdist.filename.removesuffix(".tar.gz")
    if not (root / "pyproject.toml").is_file():
        raise BuildError(f"{sdist.filename}: no {root.name}/pyproject.toml inside; "
                         f"is [sdist] filename a vLLM source release?")
    return root


def extract_sdist(tarball: Path, sdist: Sdist, dest: Path) -> Path:
    """Extract `tarball` into `dest` once (marked with its sha256); return the source root."""
    mark = dest / EXTRACTED_MARK
    if mark.is_file() and mark.read_text().strip() == sdist.sha256:
        return _source_root(dest, sdist)
    if dest.exists():
        shutil.rmtree(dest)
    partial = dest.with_name(dest.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    with tarfile.open(tarball) as archive:
        archive.extractall(partial, filter="data")
    (partial / EXTRACTED_MARK).write_text(sdist.sha256 + "\n")
    partial.rename(dest)
    return _source_root(dest, sdist)


def fetch_sdist(request: BuildRequest) -> Path:
    """The extracted source root of the base's pinned sdist (fetched and checked if needed)."""
    _, sdist, tarball = cached_sdist(request)
    extracted = tarball.with_name(sdist.filename.removesuffix(".tar.gz") + "-src")
    return extract_sdist(tarball, sdist, extracted)
