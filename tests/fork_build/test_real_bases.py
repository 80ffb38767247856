"""The real thing: the series against every pinned base, and the CPU fork wheel as
installed.

These use the pinned upstream wheels (fetched into the build cache by pip) and
the wheel `tools/setup-test-env.sh` built into dist/cpu and installed into the
venv running the tests.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tests.fork_build.fakefork import ROOT
from tools.forkbuild.apply import touched_paths
from tools.forkbuild.build import BuildRequest, base_releases, load_series, resolve
from tools.forkbuild.pins import load_pins
from tools.forkbuild.workflow import check

FORK_VERSION = re.compile(
    r"^0\.31\.0\+r3\.\d+(\.dev\d+\.g[0-9a-f]{7})?(\.d\d{8})?\.cpu$"
)


@pytest.fixture(scope="module")
def built_wheel() -> Path:
    wheels = sorted((ROOT / "dist" / "cpu").glob("vllm-*.whl"))
    assert len(wheels) == 1, (
        f"expected one CPU fork wheel in dist/cpu, found {wheels}; run make venv"
    )
    return wheels[0]


def _request(variant: str, arch: str = "x86_64") -> BuildRequest:
    return BuildRequest(root=ROOT, variant=variant, arch=arch, out_dir=ROOT / "dist")


def test_series_applies_to_every_pinned_base() -> None:
    pins = load_pins(ROOT / "pins.toml")
    assert {(w.variant, w.arch) for w in pins.wheels} >= {
        ("cuda", "x86_64"),
        ("cpu", "x86_64"),
    }
    assert check(_request("cpu"), all_pins=True) == []


def test_every_carried_series_applies_to_its_pinned_bases() -> None:
    carried = base_releases(ROOT)[1:]
    assert "0.34.0" in carried
    for release in carried:
        request = BuildRequest(
            root=ROOT,
            variant="cuda",
            arch="x86_64",
            out_dir=ROOT / "dist",
            release=release,
        )
        assert load_series(request.patches_dir)  # a series, not an empty directory
        assert check(request, all_pins=True) == []


def test_installed_fork_reports_the_fork_version_everywhere(built_wheel: Path) -> None:
    version = built_wheel.name.split("-")[1]
    assert FORK_VERSION.match(version), version
    assert importlib.metadata.version("vllm") == version
    import vllm

    assert vllm.__version__ == version
    cli = subprocess.run(
        [str(Path(sys.executable).parent / "vllm"), "--version"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip().splitlines()[-1] == version


def test_requirements_are_the_base_release_ones(built_wheel: Path) -> None:
    _, _, base = resolve(_request("cpu"))

    def requires(path: Path) -> list[str]:
        with zipfile.ZipFile(path) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            return [
                l
                for l in zf.read(meta).decode().splitlines()
                if l.startswith("Requires-")
            ]

    assert requires(built_wheel) == requires(base)
    assert len(requires(base)) > 20


def _so_digests(path: Path) -> dict[str, str]:
    with zipfile.ZipFile(path) as zf:
        return {
            n: hashlib.sha256(zf.read(n)).hexdigest()
            for n in zf.namelist()
            if n.endswith(".so")
        }


def test_compiled_modules_are_byte_identical_to_the_base(built_wheel: Path) -> None:
    _, _, base = resolve(_request("cpu"))
    base_so = _so_digests(base)
    assert len(base_so) >= 3, sorted(base_so)
    assert _so_digests(built_wheel) == base_so
    # And what pip installed is what the wheel carried.
    site = Path(importlib.util.find_spec("vllm").origin).parent.parent
    for name, digest in base_so.items():
        assert hashlib.sha256((site / name).read_bytes()).hexdigest() == digest, name


def test_only_patched_files_and_version_differ_from_the_base(built_wheel: Path) -> None:
    _, _, base = resolve(_request("cpu"))
    with zipfile.ZipFile(base) as b, zipfile.ZipFile(built_wheel) as f:
        base_files = {
            n: b.read(n)
            for n in b.namelist()
            if not n.split("/")[0].endswith(".dist-info")
        }
        fork_files = {
            n: f.read(n)
            for n in f.namelist()
            if not n.split("/")[0].endswith(".dist-info")
        }
    changed = {
        n
        for n in base_files.keys() & fork_files.keys()
        if base_files[n] != fork_files[n]
    }
    patched = touched_paths(load_series(ROOT / "patches"))
    assert "vllm/triton_utils/importing.py" in patched  # patch 0001
    # The files the fork adds are exactly the repository's vllm/ modules, byte for byte.
    modules = {
        p.relative_to(ROOT).as_posix(): p.read_bytes()
        for p in (ROOT / "vllm").rglob("*.py")
    }
    assert modules.keys() & base_files.keys() == set()  # none shadows upstream's
    assert {n: fork_files[n] for n in fork_files.keys() - base_files.keys()} == modules
    assert base_files.keys() - fork_files.keys() <= patched  # files the series deletes
    assert changed == (patched & base_files.keys()) | {"vllm/_version.py"}
