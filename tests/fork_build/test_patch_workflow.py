"""The patch workflow on the fake fork: checkout, commit, export, check."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from tests.fork_build.fakefork import PATCH_UNSIGNED, FakeFork
from tools.forkbuild import BuildError
from tools.forkbuild.build import BuildRequest
from tools.forkbuild.workflow import check, checkout, export, slug


def _request(fork: FakeFork) -> BuildRequest:
    return BuildRequest(
        root=fork.root,
        variant="cpu",
        arch="x86_64",
        out_dir=fork.root / "dist",
        cache_dir=fork.cache,
        label="r3.0",
    )


def _snapshot(patches: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(patches.iterdir())}


def test_checkout_has_one_commit_per_patch(fake_fork: FakeFork, tmp_path: Path) -> None:
    tree = tmp_path / "src"
    checkout(_request(fake_fork), tree)
    log = subprocess.run(
        ["git", "-C", str(tree), "log", "--format=%s"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert log[0] == "[Misc] Greet politely"
    assert len(log) == 2 and log[1].startswith("vllm-fake 9.8.7 (cpu/x86_64 base)")
    assert (tree / "vllm/added.py").read_text() == "ADDED = True\n"
    assert not (tree / "vllm/_C.abi3.so").exists()  # compiled modules stay in the wheel
    with pytest.raises(BuildError, match="already exists"):
        checkout(_request(fake_fork), tree)


def test_export_of_an_unchanged_tree_reproduces_the_series(
    fake_fork: FakeFork, tmp_path: Path
) -> None:
    before = _snapshot(fake_fork.patches)
    tree = tmp_path / "src"
    checkout(_request(fake_fork), tree)
    export(tree, _request(fake_fork))
    first = _snapshot(fake_fork.patches)
    # Exported once, the files are in canonical form; exporting again changes no byte,
    # and a fresh checkout of the exported series exports the same bytes too.
    export(tree, _request(fake_fork))
    assert _snapshot(fake_fork.patches) == first
    checkout(_request(fake_fork), tmp_path / "src2")
    export(tmp_path / "src2", _request(fake_fork))
    assert _snapshot(fake_fork.patches) == first
    # same names: 0001-greet-politely.patch, prs.toml and series
    assert set(first) == set(before)
    assert (fake_fork.root / "vllm/added.py").read_text() == "ADDED = True\n"


def test_a_new_commit_becomes_the_next_patch(
    fake_fork: FakeFork, tmp_path: Path
) -> None:
    tree = tmp_path / "src"
    checkout(_request(fake_fork), tree)
    (tree / "vllm/greeting.py").write_text(
        (tree / "vllm/greeting.py").read_text() + "\nLOUD = False\n"
    )
    git = [
        "git",
        "-C",
        str(tree),
        "-c",
        "user.name=Test",
        "-c",
        "user.email=test@example.invalid",
    ]
    subprocess.run(
        git + ["commit", "-s", "-qam", "[Core] Add a LOUD switch\n\n" + "Why: " * 25],
        check=True,
    )
    export(tree, _request(fake_fork))
    series = (fake_fork.patches / "series").read_text().split("\n")
    assert [l for l in series if l and not l.startswith("#")] == [
        "0001-greet-politely.patch",
        "0002-add-a-loud-switch.patch",
    ]
    assert check(_request(fake_fork), all_pins=True) == []


def test_export_refuses_uncommitted_work(fake_fork: FakeFork, tmp_path: Path) -> None:
    tree = tmp_path / "src"
    checkout(_request(fake_fork), tree)
    (tree / "vllm/greeting.py").write_text("broken\n")
    with pytest.raises(BuildError, match="uncommitted changes"):
        export(tree, _request(fake_fork))


def test_slug_drops_component_tags() -> None:
    assert (
        slug("[CPU] Run Model Runner V2 through Triton's interpreter, opt-in")
        == "run-model-runner-v2-through-triton-s-interpreter"
    )


def test_check_refuses_a_patch_without_sign_off(fake_fork: FakeFork) -> None:
    """vLLM's DCO check: the series' own fixture is signed (the control, above); the
    same patch without its trailer fails `check`, naming the patch and the fix."""
    assert check(_request(fake_fork)) == []
    fake_fork.write_series({"0001-greet-politely.patch": PATCH_UNSIGNED})
    assert check(_request(fake_fork)) == [
        "0001-greet-politely.patch: no `Signed-off-by: Name <address>` line; vLLM accepts "
        "only commits signed off under the DCO. Sign it in the working tree "
        "(`git commit -s --amend` for the last commit, or `git rebase --signoff base` for "
        "every commit), then `python -m tools.fork export`"
    ]


def test_a_sign_off_survives_checkout_and_export(
    fake_fork: FakeFork, tmp_path: Path
) -> None:
    tree = tmp_path / "src"
    checkout(_request(fake_fork), tree)
    [exported] = export(tree, _request(fake_fork))
    assert (
        "\nSigned-off-by: Fork Dev <dev@example.invalid>\n---\n" in exported.read_text()
    )


def _git(tree: Path) -> list[str]:
    return ["git", "-C", str(tree), "-c", "user.name=Test",
            "-c", "user.email=test@example.invalid"]


def test_a_module_joins_its_prs_first_commit_and_exports_to_vllm(
    fake_fork: FakeFork, tmp_path: Path
) -> None:
    """The module is in the working tree, in the commit of the PR that adds it, never
    in a patch; an edit of it goes back to the repository's vllm/, not to patches/."""
    tree = tmp_path / "src"
    checkout(_request(fake_fork), tree)
    export(tree, _request(fake_fork))
    before = _snapshot(fake_fork.patches)
    shown = subprocess.run(_git(tree) + ["show", "--name-only", "--format=", "HEAD"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert shown == ["vllm/added.py", "vllm/greeting.py"]
    (tree / "vllm/added.py").write_text("ADDED = False\n")
    subprocess.run(_git(tree) + ["commit", "-qam", "fixup! [Misc] Greet politely"],
                   check=True)
    export(tree, _request(fake_fork))
    assert (fake_fork.root / "vllm/added.py").read_text() == "ADDED = False\n"
    assert _snapshot(fake_fork.patches) == before  # the patch is untouched
    assert "added.py" not in (fake_fork.patches / "0001-greet-politely.patch").read_text()


def test_a_new_file_exports_as_a_module(fake_fork: FakeFork, tmp_path: Path) -> None:
    tree = tmp_path / "src"
    checkout(_request(fake_fork), tree)
    (tree / "vllm/brand_new.py").write_text("NEW = 1\n")
    subprocess.run(_git(tree) + ["add", "vllm/brand_new.py"], check=True)
    subprocess.run(_git(tree) + ["commit", "-s", "-qm", "[Misc] A new module\n\n"
                                 + "Why: " * 25], check=True)
    assert [p.name for p in export(tree, _request(fake_fork))] == [
        "0001-greet-politely.patch"]  # a commit of modules only is no patch
    assert (fake_fork.root / "vllm/brand_new.py").read_text() == "NEW = 1\n"


def test_export_refuses_to_overwrite_a_module_changed_since_checkout(
    fake_fork: FakeFork, tmp_path: Path
) -> None:
    """A module edited in the repository after checkout would be replaced by the
    working tree's older copy; export refuses, names it, and writes nothing."""
    tree = tmp_path / "src"
    checkout(_request(fake_fork), tree)
    export(tree, _request(fake_fork))  # the control: nothing changed, it exports
    before = _snapshot(fake_fork.patches)
    fake_fork.write_module("vllm/added.py", "ADDED = 'edited in the repository'\n")
    with pytest.raises(BuildError) as err:
        export(tree, _request(fake_fork))
    assert str(err.value).startswith(
        "vllm/added.py changed in this repository since "
        f"{tree} was checked out, and the working tree has another version"
    )
    assert (fake_fork.root / "vllm/added.py").read_text() == (
        "ADDED = 'edited in the repository'\n"
    )
    assert _snapshot(fake_fork.patches) == before
    # Brought into the working tree, the change exports.
    (tree / "vllm/added.py").write_text("ADDED = 'edited in the repository'\n")
    subprocess.run(_git(tree) + ["commit", "-qam", "fixup! [Misc] Greet politely"],
                   check=True)
    export(tree, _request(fake_fork))
