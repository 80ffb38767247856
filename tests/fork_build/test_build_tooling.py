"""The build tooling on small fixtures: repack, stamp, the fork's modules, and the
failure messages."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile
from pathlib import Path

import pytest
from tests.fork_build.fakefork import (
    BASE_FILENAME,
    PATCH_CREATES,
    PATCH_GOOD,
    RELEASE,
    SO_BYTES,
    TAG,
    FakeFork,
)
from tools.forkbuild import BuildError
from tools.forkbuild.build import BuildRequest, build_fork_wheel
from tools.forkbuild.series import header_problems, parse_patch, read_series
from tools.forkbuild.version import fork_version

LABEL = "r3.4.dev2.gabcdef0"


def _build(fork: FakeFork, out: Path) -> Path:
    request = BuildRequest(
        root=fork.root,
        variant="cpu",
        arch="x86_64",
        out_dir=out,
        cache_dir=fork.cache,
        label=LABEL,
    )
    return build_fork_wheel(request)


def test_builds_a_vllm_wheel_with_the_fork_version(
    fake_fork: FakeFork, tmp_path: Path
) -> None:
    wheel = _build(fake_fork, tmp_path / "dist")
    version = f"{RELEASE}+{LABEL}.cpu"
    assert wheel.name == f"vllm-{version}-{TAG}.whl"
    with zipfile.ZipFile(wheel) as zf:
        info = f"vllm-{version}.dist-info"
        metadata = zf.read(f"{info}/METADATA").decode()
        assert "Name: vllm\n" in metadata and f"Version: {version}\n" in metadata
        # Requires-Dist and the body are the base's, untouched.
        assert "Requires-Dist: numpy\n" in metadata
        assert 'Requires-Dist: tiny-extra-dep; extra == "bench"' in metadata
        assert metadata.endswith("The body stays as it is.\n")
        wheel_file = zf.read(f"{info}/WHEEL").decode()
        assert wheel_file.count("Tag:") == 1 and f"Tag: {TAG}\n" in wheel_file
        assert (
            f"__version__ = version = '{version}'"
            in zf.read("vllm/_version.py").decode()
        )
        assert (
            "(9, 8, 7, 'r3.4.dev2.gabcdef0.cpu')"
            in zf.read("vllm/_version.py").decode()
        )
        # The series ran, and the fork's module is in: a changed file, an added one.
        assert '"good day, "' in zf.read("vllm/greeting.py").decode()
        assert zf.read("vllm/added.py") == b"ADDED = True\n"
        # Compiled modules are the base's bytes.
        assert zf.read("vllm/_C.abi3.so") == SO_BYTES
        assert not any(n.startswith("vllm_fake-") for n in zf.namelist())


def test_record_lists_every_file_with_its_hash(
    fake_fork: FakeFork, tmp_path: Path
) -> None:
    wheel = _build(fake_fork, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode())))
        assert sorted(r[0] for r in rows) == sorted(names)
        for path, digest, size in rows:
            if path == record_name:
                assert digest == "" and size == ""
                continue
            data = zf.read(path)
            expected = (
                base64.urlsafe_b64encode(hashlib.sha256(data).digest())
                .rstrip(b"=")
                .decode()
            )
            assert digest == f"sha256={expected}" and int(size) == len(data), path


def test_wrong_hash_names_file_expected_and_actual(
    fake_fork: FakeFork, tmp_path: Path
) -> None:
    wrong = "0" * 64
    fake_fork.write_pins(sha256=wrong)
    actual = hashlib.sha256(fake_fork.base_wheel.read_bytes()).hexdigest()
    with pytest.raises(BuildError) as err:
        _build(fake_fork, tmp_path / "dist")
    message = str(err.value)
    assert BASE_FILENAME in message
    assert f"expected {wrong}" in message and f"actual   {actual}" in message
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())


@pytest.mark.parametrize(
    ("broken", "where"),
    [
        # A stale hunk: its context no longer matches upstream.
        (
            PATCH_GOOD.replace(
                '-    return "hello " + name', '-    return "hi " + name'
            ),
            "file vllm/greeting.py, hunk @@ -1,5 +1,5 @@",
        ),
        # A corrupt hunk: the header promises more lines than follow.
        (
            PATCH_GOOD.replace("@@ -1,5 +1,5 @@", "@@ -1,9 +1,9 @@"),
            "file vllm/greeting.py, hunk @@ -1,9 +1,9 @@ (the patch is corrupt at line",
        ),
    ],
    ids=["stale", "corrupt"],
)
def test_patch_that_does_not_apply_names_patch_file_and_hunk(
    fake_fork: FakeFork, tmp_path: Path, broken: str, where: str
) -> None:
    fake_fork.write_series({"0001-greet-politely.patch": broken})
    with pytest.raises(BuildError) as err:
        _build(fake_fork, tmp_path / "dist")
    message = str(err.value)
    assert "patch 0001-greet-politely.patch does not apply" in message
    assert where in message
    assert (
        not list((tmp_path / "dist").glob("*.whl"))
        if (tmp_path / "dist").exists()
        else True
    )


def test_series_and_directory_must_agree(fake_fork: FakeFork) -> None:
    (fake_fork.patches / "0002-unlisted.patch").write_text(PATCH_GOOD)
    with pytest.raises(BuildError, match="does not list 0002-unlisted.patch"):
        read_series(fake_fork.patches)
    (fake_fork.patches / "series").write_text(
        "0001-greet-politely.patch\n0003-missing.patch\n"
    )
    with pytest.raises(
        BuildError, match="lists 0003-missing.patch, which does not exist"
    ):
        read_series(fake_fork.patches)


def test_header_review_wants_subject_and_why(fake_fork: FakeFork) -> None:
    good = parse_patch(fake_fork.patches / "0001-greet-politely.patch")
    assert good.subject == "[Misc] Greet politely"
    assert header_problems(good) == []
    terse = fake_fork.patches / "0002-terse.patch"
    terse.write_text(
        PATCH_GOOD.split("The greeting")[0]
        + "Fix.\n\nSigned-off-by: Fork Dev <dev@example.invalid>\n---\n"
        + PATCH_GOOD.split("---\n", 1)[1]
    )
    problems = header_problems(parse_patch(terse))
    assert len(problems) == 1 and "the body has 1 words" in problems[0]


def test_cpu_version_carries_cpu_and_cuda_never_does() -> None:
    assert fork_version("0.31.0", "r3.1", "cpu") == "0.31.0+r3.1.cpu"
    assert fork_version("0.31.0", "r3.1", "cuda") == "0.31.0+r3.1"


def test_a_patch_that_creates_a_file_is_refused(
    fake_fork: FakeFork, tmp_path: Path
) -> None:
    fake_fork.write_series({"0001-greet-politely.patch": PATCH_CREATES})
    with pytest.raises(BuildError) as err:
        _build(fake_fork, tmp_path / "dist")
    assert str(err.value) == (
        "0001-greet-politely.patch creates vllm/added.py: patches edit files upstream "
        "ships; put the new file at vllm/added.py in this repository (the fork's vllm/ "
        "tree), name it in its PR's `modules` in prs.toml, and drop it from the patch"
    )
    assert not (tmp_path / "dist").exists()


def test_a_module_that_shadows_an_upstream_file_is_refused(
    fake_fork: FakeFork, tmp_path: Path
) -> None:
    fake_fork.write_module("vllm/greeting.py", "def greet(name): return name\n")
    with pytest.raises(BuildError) as err:
        _build(fake_fork, tmp_path / "dist")
    source = fake_fork.root / "vllm/greeting.py"
    # The patch edits upstream's greeting.py, which is now also a module: both named.
    assert str(err.value).split("\n") == [
        f"0001-greet-politely.patch edits vllm/greeting.py, which is the fork's own "
        f"module {source}: edit that file directly and drop the change from the patch",
        f"{source} would replace vllm/greeting.py, which vllm-fake {RELEASE} "
        "(cpu/x86_64 base) ships: the fork's modules add files, they never shadow "
        "upstream's. Edit upstream's file with a patch (python -m tools.fork checkout, "
        f"commit, export) and remove {source}",
    ]


def test_a_carried_bases_own_copy_replaces_the_shared_module(tmp_path: Path) -> None:
    from tools.forkbuild.modules import fork_modules

    root = tmp_path / "repo"
    for where, text in (("vllm/a.py", "A = 1\n"), ("vllm/b.py", "B = 1\n"),
                        ("bases/9.9.0/vllm/b.py", "B = 2\n"),
                        ("vllm/__pycache__/a.cpython-311.pyc", "")):
        (root / where).parent.mkdir(parents=True, exist_ok=True)
        (root / where).write_text(text)
    primary = fork_modules(root, root)
    carried = fork_modules(root, root / "bases/9.9.0")
    assert {path: p.read_text() for path, p in primary.items()} == {
        "vllm/a.py": "A = 1\n", "vllm/b.py": "B = 1\n"}
    assert {path: p.read_text() for path, p in carried.items()} == {
        "vllm/a.py": "A = 1\n", "vllm/b.py": "B = 2\n"}
