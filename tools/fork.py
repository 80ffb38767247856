#!/usr/bin/env python3
"""The fork's command line: build the wheel and work on the patch series.

The loop (docs/patch-workflow.md): checkout, edit and commit in the working
tree (one commit per patch, its message the PR description), export, test.

Each command is declared once, in `COMMANDS`: its name, its one-line help, its
options (each with its help) and the function that runs it. The parser, the
dispatch and the usage lines of `python -m tools.fork --help` are built from that
table, so the help lists every command with every option it takes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tools.forkbuild import BuildError, ci, crossbase, drift, lint, prs, standin, workflow
from tools.forkbuild.build import (
    BuildRequest,
    base_label,
    base_releases,
    build_fork_wheel,
    load_series,
    newest_release,
    request_from_env,
    resolve,
)
from tools.forkbuild.fetch import cached_ruff, default_cache_dir
from tools.forkbuild.pins import VARIANTS, load_pins
from tools.forkbuild.sdist import fetch_sdist
from tools.forkbuild.version import fork_label, fork_version

ROOT = Path(__file__).resolve().parent.parent
PROG = "python -m tools.fork"


@dataclass(frozen=True)
class Option:
    """One option of a command: the arguments of argparse's `add_argument`, which
    `add_to` passes unchanged. Made by `option`, which insists on a help string."""

    flags: tuple[str, ...]
    settings: Mapping[str, Any]

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(*self.flags, **self.settings)


def option(*flags: str, **settings: Any) -> Option:
    """An `Option`; raises ValueError when `settings` has no help text, so that no
    option reaches `--help` unexplained."""
    if not settings.get("help"):
        raise ValueError(f"option {'/'.join(flags)} has no help text")
    return Option(flags, MappingProxyType(settings))


class _UsageLine(argparse.HelpFormatter):
    """argparse's usage formatting, indented four spaces instead of `usage: `: one
    command's line in the top-level help (wrapped under its options when long)."""

    def add_usage(self, usage: str | None, actions: Iterable[argparse.Action],
                  groups: Iterable[Any], prefix: str | None = None) -> None:
        super().add_usage(usage, actions, groups, prefix="    ")


def _add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    for opt in options:
        opt.add_to(parser)


def usage_line(name: str, options: Sequence[Option]) -> str:
    """`    python -m tools.fork NAME [OPTION ...]`: argparse's usage of `options` alone."""
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}", add_help=False,
                                     formatter_class=_UsageLine)
    _add_options(parser, options)
    return parser.format_usage().rstrip("\n")


def base_options() -> tuple[Option, ...]:
    """The options that select the base a `Command` works on (the releases it can
    name are read from the repository, hence a function)."""
    return (
        option("--base", choices=VARIANTS,
               help="base wheel variant (default: $VLLM_FORK_BASE or cuda)"),
        option("--arch", help="base wheel architecture (default: this machine)"),
        option("--base-release", metavar="X.Y.Z",
               help="the vLLM release whose series to use: the primary base "
                    f"(pins.toml) or one under bases/ (default: $VLLM_FORK_RELEASE "
                    f"or the primary base); supported: {', '.join(base_releases(ROOT))}"),
    )


@dataclass(frozen=True)
class Command:
    """A command that works on one base. Its parser takes `base_options()` and then
    `options`; `execute` turns them into the `BuildRequest` for `run`, calls
    `run(args, request)` and returns its exit code, or prints `error: ...` and returns
    1 on a BuildError. `args.command_line` is the command line after the program
    name. With `newest_by_default`, the command faces upstream: without
    --base-release (or $VLLM_FORK_RELEASE) it works on the newest carried release,
    which is what upstream PRs are sent against."""

    name: str
    help: str
    options: tuple[Option, ...]
    run: Callable[[argparse.Namespace, BuildRequest], int]
    newest_by_default: bool = False

    def all_options(self) -> tuple[Option, ...]:
        return base_options() + self.options

    def add_to(self, add_parser: Callable[..., argparse.ArgumentParser]) -> None:
        parser = add_parser(self.name, help=self.help, description=self.help)
        _add_options(parser, self.all_options())

    def execute(self, args: argparse.Namespace) -> int:
        try:
            return self.run(args, _request(args, self.newest_by_default))
        except BuildError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1


@dataclass(frozen=True)
class BareCommand:
    """A command that selects no base: its parser takes `options` only, its --help
    shows `description` as written, and `execute` returns `run(args)`, letting any
    exception through."""

    name: str
    help: str
    options: tuple[Option, ...]
    run: Callable[[argparse.Namespace], int]
    description: str

    def all_options(self) -> tuple[Option, ...]:
        return self.options

    def add_to(self, add_parser: Callable[..., argparse.ArgumentParser]) -> None:
        parser = add_parser(self.name, help=self.help, description=self.description,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_options(parser, self.options)

    def execute(self, args: argparse.Namespace) -> int:
        return self.run(args)


def _request(args: argparse.Namespace, newest_by_default: bool) -> BuildRequest:
    """The BuildRequest the base options select; they are exported to the
    environment, where the build (and any pip it runs) reads them."""
    if (newest_by_default and not args.base_release
            and not os.environ.get("VLLM_FORK_RELEASE", "").strip()):
        args.base_release = newest_release(ROOT)
    if args.base:
        os.environ["VLLM_FORK_BASE"] = args.base
    if args.base_release:
        os.environ["VLLM_FORK_RELEASE"] = args.base_release
    if args.arch:
        os.environ["VLLM_FORK_ARCH"] = args.arch
    return request_from_env(ROOT, Path(getattr(args, "output", None) or "dist"))


def _report(command: str, problems: Sequence[str], ok: str) -> int:
    """Print each problem to stderr as `COMMAND: problem` and return 1, or print
    `COMMAND: OK` and return 0 when there are none."""
    for problem in problems:
        print(f"{command}: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"{command}: {ok}")
    return 0


def _release(request: BuildRequest) -> str:
    return load_pins(request.pins_path).release


def _export_prs(args: argparse.Namespace, request: BuildRequest) -> int:
    release = _release(request)
    plan = prs.load_plan(prs.plan_path(request.patches_dir), release)
    out = Path(args.output) if args.output else Path("build") / "prs" / release
    out = out if out.is_absolute() else ROOT / out
    pins, wheel, base = resolve(request)
    written = prs.export_prs(plan, load_series(request.patches_dir), request.modules, ROOT,
                             out, release, base, base_label(pins, wheel))
    for path in written:
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


def _test_python(release: str, python: str | None) -> str:
    """The interpreter that has this base's fork installed (make test builds them)."""
    if python:
        return python
    primary = load_pins(ROOT / "pins.toml").release
    venv = ".venv" if release == primary else f".venv-{release}"
    path = ROOT / venv / "bin" / "python"
    if not path.exists():
        raise BuildError(
            f"{path} does not exist: check-prs runs vLLM {release}'s PR tests with the "
            f"fork installed there. Build it (`VLLM_FORK_RELEASE={release} "
            f"VENV={ROOT / venv} bash tools/setup-test-env.sh`, which make test runs) or "
            f"pass --python")
    return str(path)


def _check_prs(args: argparse.Namespace, request: BuildRequest) -> int:
    release = _release(request)
    plan = prs.load_plan(prs.plan_path(request.patches_dir), release)
    pins, wheel, base = resolve(request)
    python = _test_python(release, args.python)
    installed = subprocess.run(
        [python, "-c", "import pathlib, vllm; print(pathlib.Path(vllm.__file__).parent)"],
        check=True, capture_output=True, text=True).stdout.strip()
    # A base without a CPU build runs on its CPU stand-in (docs/bases.md), which needs
    # vLLM told to pick its CPU platform.
    has_cpu_build = any(w.variant == "cpu" for w in pins.wheels)
    env = {} if has_cpu_build else standin.standin_env()
    problems = prs.check_prs(plan, load_series(request.patches_dir), request.modules, ROOT,
                             base, base_label(pins, wheel), Path(installed), python, env=env)
    return _report("check-prs", problems, f"ok (vLLM {release})")


def _sdist_root(request: BuildRequest, given: str | None) -> Path:
    """The extracted sdist of the request's release: --sdist, or forkbuild.sdist."""
    release = _release(request)
    root = Path(given) if given else fetch_sdist(request)
    have = lint.sdist_release(root)
    if have != release:
        raise BuildError(f"{root} is the sdist of vLLM {have}, not {release}; pass the "
                         f"one of {release}")
    return root


def _lint_base(request: BuildRequest, sdist: str | None, ruff: str | None,
               fix: bool = False) -> int:
    """Lint one base's PRs (after fixing this repository's files, with `fix`); print
    the findings; return how many."""
    release = _release(request)
    source_root = _sdist_root(request, sdist)
    version = lint.pinned_ruff_version(source_root)
    try:
        ruff = lint.find_ruff(version, ruff)
    except BuildError:
        if ruff is not None:  # the one asked for is not the pinned version
            raise
        ruff = lint.find_ruff(version, str(cached_ruff(version)))
    plan = prs.load_plan(prs.plan_path(request.patches_dir), release)
    series = load_series(request.patches_dir)
    problems = prs.plan_problems(plan, series, ROOT, request.modules)
    if problems:
        raise BuildError("\n".join(problems))
    pins, wheel, base = resolve(request)
    if fix:
        for path in lint.fix_repo_files(plan, series, request.modules, ROOT, base,
                                        base_label(pins, wheel), source_root, ruff):
            print(f"lint: vLLM {release}: fixed {path.relative_to(ROOT)}", file=sys.stderr)
    findings = lint.lint_prs(plan, series, request.modules, ROOT, base,
                             base_label(pins, wheel), source_root, ruff)
    findings += [finding for patch in series
                 for finding in lint.capability_findings(patch.path.name,
                                                         patch.path.read_text())]
    findings += [finding for path, source in request.modules.items()
                 for finding in lint.module_capability_findings(
                     str(source.relative_to(ROOT)), path, source.read_text())]
    for finding in findings:
        print(f"lint: vLLM {release}: {finding}", file=sys.stderr)
    files = len(lint.lint_targets(plan, series, ROOT, request.modules))
    state = f"{len(findings)} findings" if findings else "clean"
    print(f"lint: vLLM {release}: ruff {version} over {files} files the PRs add or "
          f"change, and no class names or attribute probes in the patches or the fork's "
          f"modules: {state}")
    return len(findings)


def _build(args: argparse.Namespace, request: BuildRequest) -> int:
    print(build_fork_wheel(request))
    return 0


def _version(args: argparse.Namespace, request: BuildRequest) -> int:
    pins = load_pins(request.pins_path)
    pins.select(request.variant, request.arch)  # a base that is pinned
    print(fork_version(pins.release, fork_label(ROOT), request.variant))
    return 0


def _checkout(args: argparse.Namespace, request: BuildRequest) -> int:
    workflow.checkout(request, Path(args.dir), force=args.force)
    return 0


def _export(args: argparse.Namespace, request: BuildRequest) -> int:
    for path in workflow.export(Path(args.dir), request):
        print(path.relative_to(ROOT))
    return 0


def _check(args: argparse.Namespace, request: BuildRequest) -> int:
    """The selected base (every pinned wheel of it, or with --only-selected the one
    --base/--arch select), or without --base-release every base."""
    if args.only_selected or args.base_release:
        problems = workflow.check(request, all_pins=not args.only_selected)
    else:
        problems = [problem for release in base_releases(ROOT)
                    for problem in workflow.check(replace(request, release=release))]
    return _report("check", problems, "ok")


def _drift(args: argparse.Namespace, request: BuildRequest) -> int:
    pins = load_pins(request.pins_path)
    wheel = pins.select(request.variant, request.arch)
    release = drift.fetch_release(wheel.project, args.release, wheel.platform,
                                  request.cache_dir or default_cache_dir())
    label = f"{wheel.project} {args.release} ({request.variant}/{wheel.arch} base)"
    report, names = drift.release_drift(release, load_series(request.patches_dir), label)
    shadowed = drift.shadowed_modules(request.modules, names)
    print(drift.markdown(label, release, report, shadowed))
    return 0


def _cpu_standin_requirements(args: argparse.Namespace, request: BuildRequest) -> int:
    print("\n".join(standin.cpu_standin_requirements(request)))
    return 0


def _check_bases(args: argparse.Namespace, request: BuildRequest) -> int:
    return _report("check-bases", crossbase.check_bases(ROOT),
                   f"ok: every patch makes the same change on "
                   f"{', '.join(base_releases(ROOT))}, apart from the recorded differences")


def _lint(args: argparse.Namespace, request: BuildRequest) -> int:
    """Lint the selected base's PRs, or with --all-bases every base's; 1 on any finding."""
    releases = base_releases(ROOT) if args.all_bases else [_release(request)]
    if args.all_bases and args.sdist:
        raise BuildError("--sdist names one release's sources; drop it with "
                         "--all-bases (each base's sdist is fetched)")
    findings = sum((_lint_base(replace(request, release=release), args.sdist, args.ruff,
                               args.fix)
                    for release in releases), 0)
    return 1 if findings else 0


def _docs(args: argparse.Namespace, request: BuildRequest) -> int:
    """Rewrite the generated blocks (naming each), or with --check name the stale
    ones as problems; then check the pages."""
    from tools.forkbuild import docs
    stale = docs.update_docs(ROOT, check=args.check)
    problems = docs.docs_problems(ROOT)
    if args.check:
        problems = stale + problems
    else:
        for line in stale:
            print(f"docs: {line}")
    return _report("docs", problems, "ok: every generated block is current")


def _upstream_tests(args: argparse.Namespace, request: BuildRequest) -> int:
    from tools.forkbuild import upstream_tests
    return upstream_tests.main(request, args.python, args.record, args.full,
                               args.command_line, tuple(args.area),
                               args.jobs or upstream_tests.default_jobs(),
                               args.stock_python)


def _ci(args: argparse.Namespace) -> int:
    return ci.main(ROOT, sys.executable, args.only, args.pytest_args, args.list)


COMMANDS: tuple[Command | BareCommand, ...] = (
    Command("build", "build the fork wheel into a directory", (
        option("-o", "--output", default="dist", help="output directory (default: dist)"),
    ), _build),
    Command("version", "print the version the build would stamp", (), _version),
    Command("checkout", "materialise a git working tree: base commit + one commit per patch", (
        option("--dir", default="build/vllm-src", help="where (default: build/vllm-src)"),
        option("--force", action="store_true", help="replace an existing working tree"),
    ), _checkout),
    Command("export", "export the working tree's commits into patches/ and rewrite the series", (
        option("--dir", default="build/vllm-src",
               help="the working tree (default: build/vllm-src)"),
    ), _export),
    Command("check", "apply the series to every pinned base and review patch headers", (
        option("--only-selected", action="store_true",
               help="check only the base selected by --base/--arch"),
    ), _check),
    Command("drift", "report, per patch, how the series applies to another upstream release", (
        option("--release", required=True,
               help="the upstream release to check (e.g. 0.34.0); its wheel is fetched "
                    "with pip into the base-wheel cache"),
    ), _drift),
    Command("cpu-standin-requirements",
            "print the requirements of a CPU stand-in for a base without a CPU build "
            "(the base's, without the GPU-only ones; see tools/forkbuild/standin.py)",
            (), _cpu_standin_requirements),
    Command("export-prs", "write a base's series as upstream PRs, one per capability "
                          "(its patches/prs.toml); default: the newest base", (
        option("-o", "--output", default=None,
               help="output directory, replaced (default: build/prs/<release>)"),
    ), _export_prs, newest_by_default=True),
    Command("check-prs", "apply a base's PRs in order to its pinned release's sources and "
                         "run each PR's unit tests there; default: the newest base", (
        option("--python", default=None,
               help="the interpreter with that base's fork installed and the test "
                    "dependencies (default: .venv/bin/python for the primary base, "
                    ".venv-<release>/bin/python for a carried one, from make test)"),
    ), _check_prs, newest_by_default=True),
    Command("lint", "run vLLM's ruff (its version and configuration, from the base's "
                    "sdist) over every file the PRs add or change; default: the newest base", (
        option("--all-bases", action="store_true", help="lint every base's PRs"),
        option("--sdist", metavar="DIR",
               help="the extracted vLLM source distribution of the base (default: "
                    "fetched and checked by forkbuild.sdist)"),
        option("--ruff", metavar="PATH",
               help="the ruff executable (default: next to this interpreter, or on PATH)"),
        option("--fix", action="store_true",
               help="first apply ruff's fixes and formatting to this repository's files "
                    "the PRs ship (tests, helpers); patched vLLM sources are fixed in "
                    "the patch working tree instead"),
    ), _lint, newest_by_default=True),
    Command("check-bases", "compare each patch's change (not its context) across bases; "
                           "fail on a difference not recorded in bases/<release>/"
                           f"{crossbase.INTENDED_NAME}", (), _check_bases),
    Command("docs", "rewrite the generated blocks of README.md and docs/ (counts, the "
                    "patch/file table, parameter paths: tools/forkbuild/docs.py)", (
        option("--check", action="store_true",
               help="rewrite nothing; exit 1 naming each stale block, and check the "
                    "pages (README length, table cells, docs index, links inside the "
                    "repository, no internal issue or stop numbers)"),
    ), _docs),
    Command("upstream-tests", "run upstream vLLM's own tests (from the pinned sdist) on the "
                              "fork and compare with the recorded stock outcomes "
                              "(tools/forkbuild/upstream_tests.py)", (
        option("--python", help="the interpreter to test (default: .venv or "
                                ".venv-<release>, the fork's test venv)"),
        option("--record", action="store_true",
               help="record stock outcomes into tests/upstream/stock-<release>.json "
                    "(--python must be a stock venv: tools/setup-stock-env.sh)"),
        option("--full", action="store_true", help="include the slow upstream files"),
        option("--area", action="append", default=[],
               help="only this upstream test path (repeatable; default: every area)"),
        option("--stock-python", metavar="PYTHON",
               help="run upstream's tests on this stock venv now and compare with "
                    "that instead of the recorded outcomes (tools/setup-stock-env.sh; "
                    "make upstream-tests-full does this)"),
        option("--jobs", type=int, default=None,
               help="pytest processes, each running whole areas (default: one per "
                    "core, at most 2)"),
    ), _upstream_tests),
    BareCommand("ci", "run make test's phases (tools/forkbuild/ci.py)", (
        option("--only", nargs="+", default=(), metavar="GLOB",
               help="only the phases whose name matches (shell-style, e.g. "
                    "'*upstream*'); --list shows the names"),
        option("--list", action="store_true", help="list the phases, run nothing"),
        option("--pytest-args", default="",
               help="extra arguments for every pytest phase (e.g. '-x')"),
    ), _ci, description=ci.__doc__ or ""),
)


def description(commands: Sequence[Command | BareCommand]) -> str:
    """The top-level --help text: the module docstring's summary, one usage line per
    command (its own options, as argparse renders them), the options that select the
    base and which commands take them, and the docstring's paragraph on the loop."""
    summary, loop, _ = (__doc__ or "").split("\n\n", 2)
    on_base = [c for c in commands if isinstance(c, Command)]
    bare = [c.name for c in commands if isinstance(c, BareCommand)]
    newest = ", ".join(c.name for c in on_base if c.newest_by_default)
    every = "Every command" + (f" but {', '.join(bare)}" if bare else "")
    return "\n\n".join((
        summary,
        "\n".join(usage_line(c.name, c.options) for c in commands),
        f"{every} also takes the options that select the base:\n"
        f"{usage_line('COMMAND', base_options())}\n"
        + textwrap.fill(
            "--base-release X.Y.Z works on another carried base (bases/X.Y.Z/; default: "
            "the primary base in pins.toml); `check` without it checks every base. The "
            f"upstream-facing commands ({newest}) default to the newest release the "
            "fork carries: upstream PRs target it.", width=80, break_on_hyphens=False),
        loop,
    ))


def build_parser(commands: Sequence[Command | BareCommand] = COMMANDS
                 ) -> argparse.ArgumentParser:
    """The parser of `commands`, in their order; `command` names the one chosen."""
    parser = argparse.ArgumentParser(prog=PROG, description=description(commands),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in commands:
        command.add_to(subparsers.add_parser)
    return parser


def main(argv: list[str] | None = None,
         commands: Sequence[Command | BareCommand] = COMMANDS) -> int:
    """Parse `argv` (default: sys.argv[1:]) against `commands` and run the one named;
    return its exit code. argparse exits 2 on a command line it cannot parse."""
    command_line = sys.argv[1:] if argv is None else argv
    args = build_parser(commands).parse_args(
        command_line, argparse.Namespace(command_line=command_line))
    by_name = {command.name: command for command in commands}
    return by_name[args.command].execute(args)


if __name__ == "__main__":
    sys.exit(main())
