"""Deprecated spellings of command-line names (tools/testbed/aliases.py).

Each entry point's old flag or mode value (the harness's, and
tools/testbed/ray_serve_pd.py's) parses to what its preferred name parses to, warns
once on stderr naming the preferred spelling, and is left out of --help's option list
(one sentence of the preferred option's help names it). The helper itself is checked
on a parser built here; the entry points' parsers are checked as they are.
"""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Callable

import pytest

from tools.e2e import fault_registry
from tools.testbed.aliases import deprecated_alias, deprecated_values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demo")
    parser.add_argument("--new-switch", action="store_true", help="the switch")
    deprecated_alias(parser, "--old-switch", "--new-switch")
    group = parser.add_argument_group("shape")
    group.add_argument("--new-role", choices=("prefill", "decode"), help="one role")
    deprecated_alias(group, "--old-role", "--new-role")
    parser.add_argument("--mode", choices=("a-new", "b-new"), default="a-new",
                        help="the mode")
    deprecated_values(parser, "--mode", {"a": "a-new", "b": "b-new"})
    return parser


@pytest.mark.parametrize(("new", "old"), [
    (["--new-switch"], ["--old-switch"]),
    (["--new-role", "decode"], ["--old-role", "decode"]),
    (["--new-role=prefill"], ["--old-role=prefill"]),
    (["--mode", "b-new"], ["--mode", "b"]),
    (["--mode=a-new"], ["--mode=a"]),
])
def test_both_spellings_parse_to_the_same_and_only_the_old_one_warns(
    new: list[str], old: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    preferred = _parser().parse_args(new)
    assert capsys.readouterr().err == ""
    assert _parser().parse_args(old) == preferred
    warned = capsys.readouterr().err.splitlines()
    assert len(warned) == 1
    assert re.fullmatch(r"demo: .* is deprecated; use .*", warned[0]), warned


def test_the_warning_names_the_preferred_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    _parser().parse_args(["--old-switch", "--mode", "a"])
    assert capsys.readouterr().err.splitlines() == [
        "demo: --old-switch is deprecated; use --new-switch",
        "demo: --mode a is deprecated; use --mode a-new",
    ]


def test_defaults_are_the_preferred_ones_and_do_not_warn(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parser().parse_args([])
    assert vars(args) == {"new_switch": False, "new_role": None, "mode": "a-new"}
    assert capsys.readouterr().err == ""


def test_a_value_that_is_neither_is_still_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--old-role", "both"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["--mode", "c"])
    assert "invalid choice: 'c' (choose from 'a-new', 'b-new')" in capsys.readouterr().err


def test_help_lists_the_preferred_names_and_mentions_the_old_ones_once() -> None:
    text = _parser().format_help()
    assert "{a-new,b-new}" in text
    assert {"--new-switch", "--new-role", "--mode"} <= _options(text)  # the scan sees them
    assert "--old-switch" not in _options(text) and "--old-role" not in _options(text)
    squashed = _squashed(text)
    assert "the switch. Deprecated alias: --old-switch." in squashed
    assert "Deprecated aliases: a for a-new, b for b-new." in squashed


def test_an_alias_needs_its_preferred_name_first() -> None:
    parser = argparse.ArgumentParser()
    with pytest.raises(ValueError, match="add --new before"):
        deprecated_alias(parser, "--old", "--new")
    parser.add_argument("--mode", choices=("x",))
    with pytest.raises(ValueError, match="does not take"):
        deprecated_values(parser, "--mode", {"old": "y"})


def _squashed(help_text: str) -> str:
    """--help's text on one line, words that argparse broke after a hyphen joined."""
    return re.sub(r"-\s+", "-", " ".join(help_text.split()))


def _options(help_text: str) -> set[str]:
    """The option strings --help lists: its usage and its option lines."""
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_text.split("\n\n")[0])) | {
        flag for line in help_text.splitlines() if line.startswith("  -")
        for flag in re.findall(r"--[a-z][a-z-]*", line.split("  ", 2)[1])}


# (module, its parse function, preferred argv, old argv, attribute, preferred value)
Parse = Callable[[list[str]], argparse.Namespace]


def _harness(argv: list[str]) -> argparse.Namespace:
    return importlib.import_module("tools.e2e.__main__").parse_args(argv)


def _main_args(module: str) -> Parse:
    """Parse with `module`'s main parser without running it: main() stops at the
    first thing it does after parsing (unwind_on_sigterm, which every one calls)."""
    def parse(argv: list[str]) -> argparse.Namespace:
        entry = importlib.import_module(module)
        seen: list[argparse.Namespace] = []
        original = argparse.ArgumentParser.parse_args

        def capture(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
            seen.append(original(self, args, namespace))
            raise _Parsed

        argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
        try:
            entry.main(argv)
        except _Parsed:
            pass
        finally:
            argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        return seen[0]
    return parse


class _Parsed(Exception):
    pass


ENTRY_POINTS = [
    ("tools.e2e", _harness, ["--routed-experts-transfer"], ["--rows-transfer"],
     "routed_experts_transfer", True),
    ("tools.e2e", _harness, ["--routed-experts-transfer-only-on", "prefill"],
     ["--rows-transfer-only-on", "prefill"], "routed_experts_transfer_only_on", "prefill"),
    ("tools.e2e.lease_expiry", _main_args("tools.e2e.lease_expiry"),
     ["--routed-experts-transfer"], ["--rows-transfer"], "routed_experts_transfer", True),
    ("tools.e2e.pd_endpoints", _main_args("tools.e2e.pd_endpoints"),
     ["--mode", "rows-over-nixl", "--no-routed-experts-transfer"],
     ["--mode", "rows", "--no-transfer"], "no_routed_experts_transfer", True),
    ("tools.e2e.pd_endpoints", _main_args("tools.e2e.pd_endpoints"),
     ["--mode", "proxy-merge"], ["--mode", "merge"], "mode", "proxy-merge"),
    ("tools.e2e.pd_endpoints", _main_args("tools.e2e.pd_endpoints"),
     ["--mode", "rows-over-nixl"], ["--mode", "rows"], "mode", "rows-over-nixl"),
    ("tools.e2e.soak", _main_args("tools.e2e.soak"),
     ["--mode", "rows-over-nixl"], ["--mode", "rows-transfer"], "mode", "rows-over-nixl"),
    ("tools.e2e.soak", _main_args("tools.e2e.soak"),
     ["--mode", "proxy-merge"], ["--mode", "merge"], "mode", "proxy-merge"),
    ("tools.testbed.ray_serve_pd", _main_args("tools.testbed.ray_serve_pd"),
     ["--no-routed-experts-transfer"], ["--no-rows-transfer"],
     "no_routed_experts_transfer", True),
]


@pytest.mark.parametrize(("module", "parse", "new", "old", "attribute", "value"),
                         ENTRY_POINTS, ids=[f"{e[0]} {' '.join(e[3])}" for e in ENTRY_POINTS])
def test_each_entry_point_takes_its_old_spelling_with_a_warning(
    module: str, parse: Parse, new: list[str], old: list[str], attribute: str,
    value: object, capsys: pytest.CaptureFixture[str],
) -> None:
    preferred = parse(new)
    assert getattr(preferred, attribute) == value
    assert "deprecated" not in capsys.readouterr().err
    assert parse(old) == preferred
    warned = [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]
    assert len(warned) == sum(o != n for o, n in zip(old, new)), warned
    assert all(line.startswith(f"python -m {module}") for line in warned), warned


@pytest.mark.parametrize(("module", "old"), [
    ("tools.e2e.__main__", {"--rows-transfer", "--rows-transfer-only-on"}),
    ("tools.e2e.lease_expiry", {"--rows-transfer"}),
    ("tools.e2e.pd_endpoints", {"--no-transfer"}),
    ("tools.testbed.ray_serve_pd", {"--no-rows-transfer"}),
])
def test_each_entry_points_help_lists_only_the_preferred_flags(
    module: str, old: set[str], capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    text = capsys.readouterr().out
    assert not old & _options(text)
    assert all(f"Deprecated alias: {flag}." in _squashed(text) for flag in old)


@pytest.mark.parametrize(("module", "preferred"), [
    ("tools.e2e.pd_endpoints", "--mode {proxy-merge,rows-over-nixl}"),
    ("tools.e2e.soak", "--mode {rows-over-nixl,proxy-merge}"),
])
def test_the_mode_choices_in_help_are_the_preferred_ones(
    module: str, preferred: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    assert preferred in capsys.readouterr().out


def test_the_registry_takes_an_old_mode_with_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert fault_registry.main(["list", "--mode", "proxy-merge"]) == 0
    preferred = capsys.readouterr()
    assert fault_registry.main(["list", "--mode", "merge"]) == 0
    old = capsys.readouterr()
    assert old.out == preferred.out and "no-floor" in old.out
    assert old.err == ("python -m tools.e2e.fault_registry list: --mode merge is "
                       "deprecated; use --mode proxy-merge\n")
