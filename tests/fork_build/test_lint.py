"""Lint like upstream (tools/forkbuild/lint.py) on the fake fork: vLLM's pinned ruff
version is read from the sdist's pre-commit config, findings come back as
path:line: CODE message for the patched sources and the PRs' test files, the
sdist's per-file ignores apply, and a clean tree gives no findings."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from tests.fork_build.fakefork import FakeFork
from tools.forkbuild import BuildError
from tools.forkbuild.lint import (
    Finding,
    check_findings,
    find_ruff,
    format_findings,
    lint_prs,
    lint_targets,
    pinned_ruff_version,
    sdist_release,
)
from tools.forkbuild.prs import PrPlan, PullRequest
from tools.forkbuild.series import parse_patch

RUFF = "0.14.0"  # what vLLM 0.31.0 pins; requirements/test.txt installs it
PRE_COMMIT = textwrap.dedent("""\
    repos:
    - repo: https://github.com/pre-commit/pre-commit-hooks
      rev: v9.9.9
    - repo: https://github.com/astral-sh/ruff-pre-commit
      rev: v0.14.0
      hooks:
      - id: ruff-check
""")


def _sdist(tmp_path: Path, ignores: str = "") -> Path:
    """A stand-in for an extracted vLLM sdist: its ruff config and pre-commit pin."""
    root = tmp_path / "sdist"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "PKG-INFO").write_text(
        "Metadata-Version: 2.4\nName: vllm\nVersion: 9.8.7\n"
    )
    (root / ".pre-commit-config.yaml").write_text(PRE_COMMIT)
    (root / "pyproject.toml").write_text(
        textwrap.dedent(f"""\
        [project]
        name = "vllm"
        requires-python = ">=3.10"

        [tool.ruff.lint]
        select = ["E501", "F401"]

        [tool.ruff.lint.pycodestyle]
        max-line-length = 29

        [tool.ruff.lint.per-file-ignores]
        {ignores}
    """)
    )
    return root


def _plan(fork: FakeFork, test_text: str) -> PrPlan:
    (fork.root / "tests").mkdir(exist_ok=True)
    (fork.root / "tests" / "test_greeting.py").write_text(test_text)
    pr = PullRequest(
        name="greet",
        title="[Misc] Greet politely",
        patches=("greet-politely",),
        modules=("vllm/added.py",),
        tests=("tests/test_greeting.py",),
        e2e_tests=(),
        docs=(),
        results="",
        limits="",
    )
    return PrPlan((pr,), {})


def _modules(fork: FakeFork) -> dict[str, Path]:
    return {"vllm/added.py": fork.root / "vllm/added.py"}


def _lint(fork: FakeFork, sdist: Path, test_text: str = "X = 1\n") -> list[Finding]:
    series = [parse_patch(fork.patches / "0001-greet-politely.patch")]
    return lint_prs(
        _plan(fork, test_text),
        series,
        _modules(fork),
        fork.root,
        fork.base_wheel,
        "vllm-fake 9.8.7",
        sdist,
        find_ruff(RUFF),
    )


def test_the_pinned_ruff_is_read_from_the_sdist(tmp_path: Path) -> None:
    sdist = _sdist(tmp_path)
    assert pinned_ruff_version(sdist) == "0.14.0"
    assert sdist_release(sdist) == "9.8.7"
    (sdist / ".pre-commit-config.yaml").write_text("repos: []\n")
    with pytest.raises(
        BuildError, match="no `rev:` for the https://github.com/astral-sh/"
    ):
        pinned_ruff_version(sdist)


def test_a_frozen_ruff_rev_is_read_from_its_comment(tmp_path: Path) -> None:
    # vLLM 0.34.0's form: `pre-commit autoupdate --freeze` pins a commit.
    sdist = _sdist(tmp_path)
    (sdist / ".pre-commit-config.yaml").write_text(
        "repos:\n"
        "- repo: https://github.com/astral-sh/ruff-pre-commit\n"
        "  rev: f368fb366ff7f2f808dd324b83a6d32267799e19  # frozen: v0.17.2\n"
        "  hooks:\n"
        "  - id: ruff-check\n"
    )
    assert pinned_ruff_version(sdist) == "0.17.2"
    # A commit without the comment names no version.
    (sdist / ".pre-commit-config.yaml").write_text(
        "repos:\n"
        "- repo: https://github.com/astral-sh/ruff-pre-commit\n"
        "  rev: f368fb366ff7f2f808dd324b83a6d32267799e19\n"
    )
    with pytest.raises(BuildError, match="no `rev:`"):
        pinned_ruff_version(sdist)


def test_a_ruff_of_another_version_is_refused() -> None:
    with pytest.raises(BuildError) as err:
        find_ruff("0.0.1")
    assert str(err.value).startswith(
        "vLLM pins ruff 0.0.1 (.pre-commit-config.yaml of its sdist); "
    )
    assert "is 0.14.0" in str(err.value)
    assert "python -m pip install ruff==0.0.1" in str(err.value)


def test_the_targets_are_the_patched_sources_the_modules_and_the_pr_tests(
    fake_fork: FakeFork,
) -> None:
    series = [parse_patch(fake_fork.patches / "0001-greet-politely.patch")]
    targets = lint_targets(
        _plan(fake_fork, "X = 1\n"), series, fake_fork.root, _modules(fake_fork)
    )
    assert targets == {
        "tests/test_greeting.py": fake_fork.root / "tests/test_greeting.py",
        "vllm/added.py": fake_fork.root / "vllm/added.py",  # the repository's file
        "vllm/greeting.py": None,
    }


def test_a_module_is_linted_where_it_lives(fake_fork: FakeFork, tmp_path: Path) -> None:
    fake_fork.write_module("vllm/added.py", "import os\n\nADDED = True\n")
    findings = _lint(fake_fork, _sdist(tmp_path, ignores='"vllm/greeting.py" = ["E501"]'))
    assert [str(f) for f in findings] == [
        "vllm/added.py:1: F401 [*] `os` imported but unused",
    ]


def test_the_capability_rule_reads_every_line_of_a_module() -> None:
    from tools.forkbuild.lint import module_capability_findings

    text = "X = 1\nif hasattr(obj, 'x'):\n    pass\n"
    [finding] = module_capability_findings("vllm/added.py", "vllm/added.py", text)
    assert (finding.path, finding.line, finding.code) == (
        "vllm/added.py", 2, "attribute-probe")


def test_findings_name_file_line_and_rule(fake_fork: FakeFork, tmp_path: Path) -> None:
    findings = _lint(fake_fork, _sdist(tmp_path), test_text="import os\nX=1\n")
    assert [str(f) for f in findings] == [
        "tests/test_greeting.py:1: F401 [*] `os` imported but unused",
        "tests/test_greeting.py:2: format ruff format would rewrite this hunk",
        # the patched line: `    return "good day, " + name` is 30 characters
        "vllm/greeting.py:2: E501 Line too long (30 > 29)",
    ]


def test_the_sdist_per_file_ignores_apply(fake_fork: FakeFork, tmp_path: Path) -> None:
    """The control: the same tree, clean once upstream's config ignores the rule there."""
    sdist = _sdist(tmp_path, ignores='"vllm/greeting.py" = ["E501"]')
    assert _lint(fake_fork, sdist) == []


def test_ruff_outputs_parse_into_findings() -> None:
    check = (
        "vllm/a.py:12:5: F841 Local variable `x` is assigned to but never used\n"
        "Found 1 error.\n"
    )
    assert check_findings(check) == [
        Finding(
            "vllm/a.py", 12, "F841", "Local variable `x` is assigned to but never used"
        )
    ]
    diff = textwrap.dedent("""\
        --- vllm/a.py
        +++ vllm/a.py
        @@ -7,4 +7,4 @@
         def f():
             pass
        -x=1
        +x = 1
         y = 2

        1 file would be reformatted
    """)
    assert format_findings(diff) == [
        Finding("vllm/a.py", 9, "format", "ruff format would rewrite this hunk")
    ]
