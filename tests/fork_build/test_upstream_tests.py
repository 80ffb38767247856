"""The upstream-tests tooling on small fixtures: sdist pin and hash, comparison, test
updates.

No network: the fake sdist is put into the cache as if pip had fetched it, and the
"upstream" test tree is a few lines run by this interpreter's pytest.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

import fakefork  # noqa: F401  (for fakefork.ROOT; tools/ resolves from the repository root)
from tools.forkbuild import BuildError, upstream_tests
from tools.forkbuild.build import BuildRequest
from tools.forkbuild.pins import load_pins
from tools.forkbuild.sdist import fetch_sdist
from tools.forkbuild.upstream_tests import Outcome, Run, compare, parse_test_update

RELEASE = "9.8.7"
SDIST = f"vllm-{RELEASE}.tar.gz"
BEHAVIOUR_TEST = textwrap.dedent("""\
    import os


    def test_behaviour():
        assert os.environ.get("FAKE_BEHAVIOUR", "old") == "old"


    def test_unrelated():
        assert 1 + 1 == 2


    def test_needs_a_gpu():
        raise RuntimeError("no GPU here")
""")
TEST_UPDATE = textwrap.dedent("""\
    From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
    From: Fork Dev <dev@example.invalid>
    Subject: [PATCH] tests: the new behaviour is the expected one

    The series changes the behaviour test_behaviour asserts, on purpose.

    Upstream-PR: fake-pr
    ---
    diff --git a/tests/test_behaviour.py b/tests/test_behaviour.py
    --- a/tests/test_behaviour.py
    +++ b/tests/test_behaviour.py
    @@ -2,7 +2,7 @@ import os


     def test_behaviour():
    -    assert os.environ.get("FAKE_BEHAVIOUR", "old") == "old"
    +    assert os.environ.get("FAKE_BEHAVIOUR", "old") == "new"


     def test_unrelated():
""")


def _sdist_bytes() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in ((f"vllm-{RELEASE}/pyproject.toml", "[tool.pytest.ini_options]\n"),
                           (f"vllm-{RELEASE}/PKG-INFO", f"Name: vllm\nVersion: {RELEASE}\n"),
                           (f"vllm-{RELEASE}/tests/test_behaviour.py", BEHAVIOUR_TEST)):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _repo(tmp_path: Path, sha256: str) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "pins.toml").write_text(textwrap.dedent(f"""\
        [base]
        release = "{RELEASE}"

        [[wheel]]
        variant = "cpu"
        arch = "x86_64"
        project = "vllm-fake"
        filename = "vllm_fake-{RELEASE}-cp38-abi3-manylinux_2_28_x86_64.whl"
        sha256 = "{'0' * 64}"

        [sdist]
        filename = "{SDIST}"
        sha256 = "{sha256}"
    """))
    (root / "patches").mkdir()
    (root / "patches" / "prs.toml").write_text(
        '[[pr]]\nname = "fake-pr"\nupstream = "not opened"\npatches = []\n'
    )
    return root


def _request(root: Path, cache: Path) -> BuildRequest:
    return BuildRequest(root=root, variant="cpu", arch="x86_64", out_dir=root / "dist",
                        cache_dir=cache)


@pytest.fixture
def cached_sdist(tmp_path: Path) -> tuple[Path, Path]:
    """A repository pinning the fake sdist by its real hash, and a cache holding it."""
    data = _sdist_bytes()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / SDIST).write_bytes(data)
    return _repo(tmp_path, hashlib.sha256(data).hexdigest()), cache


# ---------------------------------------------------------------- pins and fetching


def test_a_wrong_sdist_hash_is_a_clear_error_and_the_file_is_not_reused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    data = _sdist_bytes()
    (cache / SDIST).write_bytes(data)
    root = _repo(tmp_path, "ab" * 32)
    with pytest.raises(BuildError) as info:
        fetch_sdist(_request(root, cache))
    message = str(info.value)
    assert f"sha256 mismatch for {SDIST}" in message
    assert f"expected {'ab' * 32} (pinned in {root / 'pins.toml'}, [sdist] sha256)" in message
    assert f"actual   {hashlib.sha256(data).hexdigest()}" in message
    assert not (cache / SDIST).exists()


def test_the_pinned_sdist_is_extracted_once(cached_sdist: tuple[Path, Path]) -> None:
    root, cache = cached_sdist
    source = fetch_sdist(_request(root, cache))
    assert source == cache / f"vllm-{RELEASE}-src" / f"vllm-{RELEASE}"
    assert (source / "tests" / "test_behaviour.py").read_text() == BEHAVIOUR_TEST
    (source / "marker").write_text("kept")
    assert fetch_sdist(_request(root, cache)) == source
    assert (source / "marker").read_text() == "kept"


@pytest.mark.parametrize(("table", "error"), [
    ('[sdist]\nsha256 = "' + "a" * 64 + '"\n', "[sdist]: field 'filename' is missing or empty"),
    (f'[sdist]\nfilename = "{SDIST}"\n', "[sdist]: field 'sha256' is missing or empty"),
    (f'[sdist]\nfilename = "{SDIST}"\nsha256 = "xyz"\n', "[sdist]: sha256 must be 64"),
    ('[sdist]\nfilename = "vllm-1.0.0.tar.gz"\nsha256 = "' + "a" * 64 + '"\n',
     f"expected 'vllm-{RELEASE}.tar.gz'"),
])
def test_sdist_pin_errors_name_the_field(tmp_path: Path, table: str, error: str) -> None:
    path = tmp_path / "pins.toml"
    path.write_text(f'[base]\nrelease = "{RELEASE}"\n\n[[wheel]]\nvariant = "cpu"\n'
                    f'arch = "x86_64"\nproject = "vllm"\n'
                    f'filename = "vllm-{RELEASE}-cp38-abi3-manylinux_2_28_x86_64.whl"\n'
                    f'sha256 = "{"0" * 64}"\n\n{table}')
    with pytest.raises(BuildError, match=error.replace("[", r"\[").replace("]", r"\]")):
        load_pins(path)


def test_every_real_base_pins_its_sdist() -> None:
    for pins_file in (fakefork.ROOT / "pins.toml", *sorted((fakefork.ROOT / "bases").glob("*/pins.toml"))):
        pins = load_pins(pins_file)
        assert pins.sdist is not None, pins_file
        assert pins.sdist.filename == f"vllm-{pins.release}.tar.gz"


# ---------------------------------------------------------------- comparison


AREAS = ("tests/a", "tests/b.py")


def test_pass_to_fail_is_a_regression_and_fail_to_fail_is_not() -> None:
    stock = {"tests/a/test_x.py::test_1": "passed", "tests/a/test_x.py::test_2": "failed",
             "tests/b.py::test_3": "error", "tests/b.py::test_4": "passed",
             "tests/other.py::test_5": "passed"}
    fork = {"tests/a/test_x.py::test_1": Outcome("failed", "AssertionError: assert 2 == 1"),
            "tests/a/test_x.py::test_2": Outcome("failed", "RuntimeError: no GPU"),
            "tests/b.py::test_3": Outcome("error", "setup: no GPU"),
            "tests/b.py::test_4": Outcome("passed")}
    result = compare(stock, fork, AREAS)
    assert result.regressions == [("tests/a/test_x.py::test_1", "AssertionError: assert 2 == 1")]
    assert result.failing_on_stock == 2
    assert result.passed_both == 1
    assert result.stock_counts["tests/a"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}
    assert result.fork_counts["tests/b.py"] == {"passed": 1, "failed": 0, "error": 1, "skipped": 0}
    assert "tests/other.py" not in result.stock_counts


def test_a_test_the_fork_no_longer_collects_is_a_regression_unless_updated() -> None:
    stock = {"tests/a/test_x.py::test_1": "passed", "tests/a/test_y.py::test_2": "passed",
             "tests/a/test_z.py::test_3": "passed"}
    fork = {"tests/a/test_y.py": Outcome("error", "collection: ImportError: cannot import x")}
    result = compare(stock, fork, AREAS, updated_files=("tests/a/test_z.py",))
    assert result.regressions == [
        ("tests/a/test_x.py::test_1", "not collected on the fork"),
        ("tests/a/test_y.py::test_2", "collection: ImportError: cannot import x"),
    ]
    assert result.updated == ["tests/a/test_z.py::test_3"]


def test_the_report_ends_with_a_summary_counting_regressions_as_failed() -> None:
    result = compare({"tests/a/t.py::ok": "passed", "tests/a/t.py::bad": "passed"},
                     {"tests/a/t.py::ok": Outcome("passed"),
                      "tests/a/t.py::bad": Outcome("failed", "ValueError: boom")}, AREAS)
    lines = upstream_tests.report_lines("9.8.7", result)
    assert "  FAILED tests/a/t.py::bad - ValueError: boom" in lines
    assert lines[-1] == "upstream tests (vLLM 9.8.7): 1 passed, 1 failed"


# ---------------------------------------------------------------- test updates, end to end


def _run(root: Path, source: Path, env: dict[str, str]) -> Run:
    return Run(release=RELEASE, source_root=source, sdist_sha256="0" * 64,
               python=sys.executable, areas=("tests/test_behaviour.py",), env_extra=env,
               base_dir=root, prs_toml=root / "patches" / "prs.toml")


def _facts(version: str) -> object:
    return lambda python, env: {"python": "3", "torch": "t", "vllm": version}


def test_a_test_update_applies_to_the_fork_run_only(
        cached_sdist: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    root, cache = cached_sdist
    source = fetch_sdist(_request(root, cache))
    updates = upstream_tests.test_updates_dir(root)
    updates.mkdir()
    (updates / "0001-new-behaviour.patch").write_text(TEST_UPDATE)
    (updates / "series").write_text("0001-new-behaviour.patch\n")
    stock_file = root / "tests" / "upstream" / f"stock-{RELEASE}.json"

    monkeypatch.setattr(upstream_tests, "interpreter_facts", _facts(RELEASE))
    upstream_tests.record_stock(_run(root, source, {}), stock_file, "python -m tools.fork x")
    recorded = json.loads(stock_file.read_text())
    # The stock run used the tests as released: the old behaviour passes there.
    assert recorded["outcomes"] == {"tests/test_behaviour.py::test_behaviour": "passed",
                                    "tests/test_behaviour.py::test_needs_a_gpu": "failed",
                                    "tests/test_behaviour.py::test_unrelated": "passed"}
    assert recorded["runs"][0]["command"] == "python -m tools.fork x"
    # Why the failing test failed: the first line of its failure, kept for the causes.
    assert list(recorded["messages"]) == ["tests/test_behaviour.py::test_needs_a_gpu"]
    assert "no GPU here" in recorded["messages"]["tests/test_behaviour.py::test_needs_a_gpu"]

    monkeypatch.setattr(upstream_tests, "interpreter_facts", _facts(f"{RELEASE}+r3.1"))
    fork = _run(root, source, {"FAKE_BEHAVIOUR": "new"})
    updated, _ = upstream_tests.run_fork(fork, stock_file)
    assert updated.regressions == []
    assert updated.passed_both == 2 and updated.failing_on_stock == 1

    (updates / "0001-new-behaviour.patch").unlink()
    (updates / "series").write_text("")
    plain, _ = upstream_tests.run_fork(fork, stock_file)
    assert [nodeid for nodeid, _ in plain.regressions] == ["tests/test_behaviour.py::test_behaviour"]
    assert "AssertionError" in plain.regressions[0][1]


def test_the_test_update_series_lists_every_patch_and_only_those(tmp_path: Path) -> None:
    updates = tmp_path / "upstream-tests"
    updates.mkdir()
    for name in ("0002-b.patch", "0001-a.patch"):
        (updates / name).write_text(TEST_UPDATE)
    with pytest.raises(BuildError, match=r"series is missing: list the test-update patches"):
        upstream_tests.test_update_paths(updates)
    (updates / "series").write_text("# comment\n0002-b.patch\n0001-a.patch\n")
    # The series' order, not the file names'.
    assert [p.name for p in upstream_tests.test_update_paths(updates)] == [
        "0002-b.patch", "0001-a.patch"]
    (updates / "series").write_text("0001-a.patch\n0003-c.patch\n")
    with pytest.raises(BuildError) as error:
        upstream_tests.test_update_paths(updates)
    assert "not listed: 0002-b.patch; listed but missing: 0003-c.patch" in str(error.value)


def test_recording_refuses_the_fork(cached_sdist: tuple[Path, Path],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    root, cache = cached_sdist
    monkeypatch.setattr(upstream_tests, "interpreter_facts", _facts(f"{RELEASE}+r3.0.cpu"))
    run = _run(root, fetch_sdist(_request(root, cache)), {})
    with pytest.raises(BuildError, match="runs the fork"):
        upstream_tests.record_stock(run, root / "stock.json", "x")


@pytest.mark.parametrize(("edit", "error"), [
    (lambda text: text.replace("Upstream-PR: fake-pr\n", ""), "needs exactly one 'Upstream-PR:"),
    (lambda text: text.replace("fake-pr", "nope"), "'nope' is not a [[pr]] name"),
    (lambda text: text.replace("a/tests/test_behaviour.py b/tests", "a/vllm/x.py b/vllm"),
     "changes upstream's tests/ only; it changes vllm/x.py"),
])
def test_test_update_headers_are_checked(tmp_path: Path, edit: object, error: str) -> None:
    path = tmp_path / "0001-x.patch"
    path.write_text(edit(TEST_UPDATE))  # type: ignore[operator]
    with pytest.raises(BuildError) as info:
        parse_test_update(path, {"fake-pr"})
    assert error in str(info.value)



def test_the_fork_run_leaves_out_only_what_did_not_pass_on_stock() -> None:
    stock = {"tests/a/t.py::ok": "passed", "tests/a/t.py::gpu": "failed",
             "tests/a/t.py::skip": "skipped", "tests/a/ray.py": "error",
             "tests/a/u.py::old": "failed"}
    ignore, deselect = upstream_tests.not_passing_on_stock(stock, ("tests/a/u.py",))
    assert ignore == ("tests/a/ray.py",)
    assert deselect == frozenset({"tests/a/t.py::gpu", "tests/a/t.py::skip"})


def test_a_test_added_by_a_test_update_must_pass_on_the_fork() -> None:
    fork = {"tests/a/u.py::new": Outcome("failed", "AssertionError: new"),
            "tests/a/v.py::extra": Outcome("failed", "not in an updated file")}
    result = compare({}, fork, AREAS, updated_files=("tests/a/u.py",))
    assert result.regressions == [("tests/a/u.py::new", "AssertionError: new")]


def test_split_areas_runs_every_file_once_in_order_over_the_jobs(tmp_path: Path) -> None:
    # Sizes chosen so the only even split is {big} vs {a, b, node id}.
    tests = tmp_path / "tests"
    (tests / "dir").mkdir(parents=True)
    (tests / "dir" / "test_big.py").write_text("x" * 3000)
    (tests / "dir" / "test_a.py").write_text("x" * 1000)
    (tests / "dir" / "helper.py").write_text("x" * 9000)  # not a test file
    (tests / "test_b.py").write_text("x" * 1500)
    (tests / "test_c.py").write_text("x" * 5000)  # a tenth of it as a node id
    areas = ("tests/dir", "tests/test_b.py", "tests/test_c.py::test_one")
    groups = upstream_tests.split_areas(tmp_path, areas, jobs=2)
    assert sorted(groups) == [("tests/dir/test_a.py", "tests/test_b.py",
                               "tests/test_c.py::test_one"), ("tests/dir/test_big.py",)]
    assert upstream_tests.split_areas(tmp_path, areas, jobs=1) == [
        ("tests/dir/test_a.py", "tests/dir/test_big.py", "tests/test_b.py",
         "tests/test_c.py::test_one")]


def test_a_node_id_a_release_does_not_define_is_not_its_area(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_config.py").write_text(
        "def test_kept():\n    pass\n\n\ndef test_kept_longer(x):\n    pass\n"
        "\n\nclass TestGroup:\n    def test_method(self):\n        pass\n"
    )
    areas = (
        "tests/test_config.py::test_kept",
        "tests/test_config.py::test_renamed_upstream",
        "tests/test_config.py::test_kept_longer",
        "tests/test_config.py::test_method",  # not a module-level test
        "tests/test_config.py",
        "tests/v1/core",  # paths stay: run_pytest refuses a missing one
    )
    assert upstream_tests.areas_in_release(tmp_path, areas) == (
        "tests/test_config.py::test_kept",
        "tests/test_config.py::test_kept_longer",
        "tests/test_config.py",
        "tests/v1/core",
    )
