"""The command line (tools/fork.py): its table of commands and the parser built from it.

Every command of `COMMANDS` is in the top-level --help with each of its options
(at any terminal width); each command's --help exits 0 and shows every option it
takes with its help; the parser offers exactly the table's commands, in order, and
each parses to its entry; `main` runs the entry named with the base the options
select and returns its exit code (a fake table); an unknown command exits 2 with
argparse's message, also as a process; an option without help is refused.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
from tests.fork_build.fakefork import ROOT
from tools import fork
from tools.forkbuild import BuildError, ci
from tools.forkbuild.build import BuildRequest, newest_release

NAMES = [command.name for command in fork.COMMANDS]
BY_NAME = {command.name: command for command in fork.COMMANDS}
BASE_FLAGS = ("--base", "--arch", "--base-release")


def _squeezed(text: str) -> str:
    """`text` without whitespace: argparse wraps help text wherever it likes."""
    return "".join(text.split())


def _help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        fork.main(argv)
    assert exited.value.code == 0
    return capsys.readouterr().out


def _usage_lines(top_help: str) -> dict[str, str]:
    """The top-level help's usage lines, keyed by command name (or COMMAND, the base
    options' line), each with its wrapped continuation lines joined."""
    lines: dict[str, str] = {}
    current = None
    for line in top_help.splitlines():
        match = re.match(r"    python -m tools\.fork (\S+)", line)
        if match:
            current = match.group(1)
            lines[current] = line.strip()
        elif current and line.startswith("     "):
            lines[current] += " " + line.strip()
        else:
            current = None
    return lines


def _flags_shown(name: str, line: str) -> list[str]:
    """The option flags in a usage line, in order (argparse shows each option's first)."""
    rest = line.removeprefix(f"python -m tools.fork {name}")
    return re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", rest)


def _required_arguments(command: fork.Command | fork.BareCommand) -> list[str]:
    return [arg for opt in command.options if opt.settings.get("required")
            for arg in (opt.flags[0], "0.0.1")]


def test_the_table_declares_each_command_once() -> None:
    assert NAMES == ["build", "version", "checkout", "export", "check", "drift",
                     "cpu-standin-requirements", "export-prs", "check-prs", "lint",
                     "check-bases", "docs", "upstream-tests", "ci"]
    assert [c.name for c in fork.COMMANDS if isinstance(c, fork.BareCommand)] == ["ci"]
    assert [c.name for c in fork.COMMANDS
            if isinstance(c, fork.Command) and c.newest_by_default] == [
        "export-prs", "check-prs", "lint"]
    assert all(callable(command.run) for command in fork.COMMANDS)


@pytest.mark.parametrize("columns", ["60", "200"])
def test_the_top_level_help_lists_every_command_with_each_option(
        columns: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    top = _help_of(["--help"], capsys)
    lines = _usage_lines(top)
    assert list(lines) == [*NAMES, "COMMAND"]
    for name, line in lines.items():
        declared = fork.base_options() if name == "COMMAND" else BY_NAME[name].options
        assert _flags_shown(name, line) == [opt.flags[0] for opt in declared], name
    # The options the hand-written usage used to miss, and what it got wrong.
    assert lines["lint"] == (
        "python -m tools.fork lint [--all-bases] [--sdist DIR] [--ruff PATH] [--fix]")
    assert lines["upstream-tests"] == (
        "python -m tools.fork upstream-tests [--python PYTHON] [--record] [--full] "
        "[--area AREA] [--stock-python PYTHON] [--jobs JOBS]")
    assert lines["cpu-standin-requirements"] == "python -m tools.fork cpu-standin-requirements"
    assert lines["drift"] == "python -m tools.fork drift --release RELEASE"
    assert lines["ci"] == (
        "python -m tools.fork ci [--only GLOB [GLOB ...]] [--list] [--pytest-args PYTEST_ARGS]")
    assert lines["COMMAND"] == (
        "python -m tools.fork COMMAND [--base {cuda,cpu}] [--arch ARCH] [--base-release X.Y.Z]")
    squeezed = _squeezed(top)
    assert _squeezed("Every command but ci also takes the options that select the base") \
        in squeezed
    assert _squeezed("The upstream-facing commands (export-prs, check-prs, lint) default to "
                     "the newest release the fork carries") in squeezed


@pytest.mark.parametrize("command", fork.COMMANDS, ids=NAMES)
def test_each_command_help_exits_0_and_explains_every_option(
        command: fork.Command | fork.BareCommand, capsys: pytest.CaptureFixture[str]) -> None:
    out = _help_of([command.name, "--help"], capsys)
    assert out.startswith(f"usage: python -m tools.fork {command.name} [-h]")
    squeezed = _squeezed(out)
    for opt in command.all_options():
        for flag in opt.flags:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out), (command.name, flag)
        assert _squeezed(opt.settings["help"]) in squeezed, (command.name, opt.flags)
    takes_base = [flag for flag in BASE_FLAGS if f"[{flag} " in out]
    if isinstance(command, fork.Command):
        assert takes_base == list(BASE_FLAGS)
        assert _squeezed(command.help) in squeezed
    else:
        assert takes_base == []
        assert (ci.__doc__ or "").splitlines()[0] in out


def test_every_option_has_help() -> None:
    for command in fork.COMMANDS:
        for opt in command.all_options():
            assert len(str(opt.settings["help"]).split()) >= 3, (command.name, opt.flags)
    with pytest.raises(ValueError, match=r"^option -x/--ex has no help text$"):
        fork.option("-x", "--ex", action="store_true")


@pytest.mark.parametrize("command", fork.COMMANDS, ids=NAMES)
def test_each_command_parses_to_its_entry(command: fork.Command | fork.BareCommand) -> None:
    args = fork.build_parser().parse_args([command.name, *_required_arguments(command)])
    assert args.command == command.name
    assert BY_NAME[args.command] is command


def _invalid_choice(name: str) -> re.Pattern[str]:
    # Python 3.11 quotes each choice, newer ones may not: accept both.
    choices = r",\s*".join(f"'?{re.escape(n)}'?" for n in NAMES)
    return re.compile(rf"python -m tools\.fork: error: argument command: invalid choice: "
                      rf"'{re.escape(name)}' \(choose from {choices}\)$")


def test_an_unknown_command_exits_2_with_argparse_message(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        fork.main(["no-such-command"])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: python -m tools.fork [-h]")
    assert _invalid_choice("no-such-command").search(captured.err.rstrip("\n"))


def test_an_unknown_command_exits_2_as_a_process() -> None:
    result = subprocess.run([sys.executable, "-m", "tools.fork", "bulid"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stdout == ""
    assert _invalid_choice("bulid").search(result.stderr.rstrip("\n"))


def test_a_missing_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        fork.main([])
    assert exited.value.code == 2
    assert capsys.readouterr().err.endswith(
        "python -m tools.fork: error: the following arguments are required: command\n")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """main exports the base options to the environment: undone after each test.
    Each variable is set, then deleted, through monkeypatch, so its undo restores
    the value before the test (or its absence) whatever main wrote since; a bare
    delenv of an absent variable records nothing to undo."""
    for name in ("VLLM_FORK_BASE", "VLLM_FORK_ARCH", "VLLM_FORK_RELEASE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _recording(calls: list[tuple[argparse.Namespace, BuildRequest]], code: int
               ) -> Callable[[argparse.Namespace, BuildRequest], int]:
    """A command's run that records its arguments and returns `code`."""
    def run(args: argparse.Namespace, request: BuildRequest) -> int:
        calls.append((args, request))
        return code
    return run


@pytest.mark.usefixtures("clean_env")
def test_main_runs_the_named_command_on_the_base_its_options_select() -> None:
    calls: list[tuple[argparse.Namespace, BuildRequest]] = []
    other: list[tuple[argparse.Namespace, BuildRequest]] = []
    table = (
        fork.Command("other", "another command", (), _recording(other, 0)),
        fork.Command("fake", "a fake command", (
            fork.option("--times", type=int, default=1, help="how many times"),
        ), _recording(calls, 7)),
    )
    argv = ["fake", "--times", "3", "--base", "cpu", "--arch", "aarch64",
            "--base-release", "0.34.0"]
    assert fork.main(argv, table) == 7
    assert other == []
    [(args, request)] = calls
    assert (args.command, args.times, args.command_line) == ("fake", 3, argv)
    assert (request.root, request.variant, request.arch, request.release) == (
        ROOT, "cpu", "aarch64", "0.34.0")


@pytest.mark.usefixtures("clean_env")
def test_an_upstream_facing_command_defaults_to_the_newest_base(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[argparse.Namespace, BuildRequest]] = []
    newest = fork.Command("up", "upstream-facing", (), _recording(calls, 0),
                          newest_by_default=True)
    plain = fork.Command("plain", "on the primary base", (), _recording(calls, 0))
    assert fork.main(["up"], (newest, plain)) == 0
    assert calls[0][1].release == newest_release(ROOT) != fork.load_pins(
        ROOT / "pins.toml").release
    monkeypatch.delenv("VLLM_FORK_RELEASE")  # main exported the newest release
    assert fork.main(["plain"], (newest, plain)) == 0
    assert calls[1][1].release is None  # the primary base


@pytest.mark.usefixtures("clean_env")
def test_a_build_error_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    def fails(args: argparse.Namespace, request: BuildRequest) -> int:
        raise BuildError("the series does not apply")

    table = (fork.Command("fails", "always fails", (), fails),)
    assert fork.main(["fails"], table) == 1
    assert capsys.readouterr().err == "error: the series does not apply\n"
    # An unknown --base-release is a BuildError from the request, before run.
    assert fork.main(["fails", "--base-release", "1.2.3"], table) == 1
    assert capsys.readouterr().err.startswith(
        "error: VLLM_FORK_RELEASE='1.2.3': the fork has no series for vLLM 1.2.3")


def test_a_bare_command_runs_without_a_base_and_lets_errors_through() -> None:
    seen: list[argparse.Namespace] = []

    def run(args: argparse.Namespace) -> int:
        seen.append(args)
        if args.fail:
            raise BuildError("not caught")
        return 3

    table = (fork.BareCommand("bare", "no base", (
        fork.option("--fail", action="store_true", help="raise a BuildError"),
    ), run, description="a bare command"),)
    assert fork.main(["bare"], table) == 3
    assert "base_release" not in vars(seen[0])
    with pytest.raises(BuildError, match="not caught"):
        fork.main(["bare", "--fail"], table)
