"""Deprecated spellings of command-line names, kept working.

The flags and mode values of the harness's entry points (tools/e2e), the testbed's
scripts and the benchmarks follow docs/glossary.md's preferred names. A name
that scripts used before a rename stays accepted as a deprecated alias: it parses to
exactly what the preferred name parses to and prints one line to stderr naming the
preferred spelling. `--help` lists only the preferred names; each option with aliases
says so in one sentence of its help.

    parser.add_argument("--routed-experts-transfer", action="store_true", help="...")
    deprecated_alias(parser, "--rows-transfer", "--routed-experts-transfer")
    parser.add_argument("--mode", choices=("rows-over-nixl", "proxy-merge"), ...)
    deprecated_values(parser, "--mode", {"rows": "rows-over-nixl", "merge": "proxy-merge"})

Every command line with an old spelling uses these two, so an alias behaves the same
everywhere; they live in tools/testbed, the layer everything else may import
(tools/__init__.py). Standard library only, like the fault registry.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from typing import Any

# The two P/D modes (docs/glossary.md), as the entry points' `--mode` spells them.
ROWS_OVER_NIXL = "rows-over-nixl"  # the rows-transfer switch on both roles
PROXY_MERGE = "proxy-merge"  # the switch off; the P/D proxy merges the halves


def _action(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
            flag: str) -> argparse.Action:
    """The action `flag` already names (a group shares its parser's table)."""
    try:
        return parser._option_string_actions[flag]
    except KeyError:
        raise ValueError(f"add {flag} before its deprecated aliases") from None


def _warn(prog: str, old: str, new: str) -> None:
    print(f"{prog}: {old} is deprecated; use {new}", file=sys.stderr, flush=True)


def _mention(action: argparse.Action, sentence: str) -> None:
    """Append `sentence` to `action`'s help (nothing when the help is hidden)."""
    if action.help is argparse.SUPPRESS:
        return
    text = (action.help or "").rstrip()
    action.help = f"{text}{' ' if text.endswith('.') else '. ' if text else ''}{sentence}"


class _DeprecatedFlag(argparse.Action):
    """A hidden option string that warns, then does what its preferred flag does."""

    def __init__(self, option_strings: list[str], dest: str, target: argparse.Action,
                 new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=target.dest, nargs=target.nargs,
                         const=target.const, default=argparse.SUPPRESS, type=target.type,
                         choices=target.choices, help=argparse.SUPPRESS,
                         metavar=target.metavar)
        self.target = target
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        _warn(parser.prog, option_string or self.option_strings[0], self.new)
        self.target(parser, namespace, values, self.new)


def deprecated_alias(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     old: str, new: str) -> None:
    """Accept flag `old` as a deprecated spelling of the already added flag `new`:
    the same destination, value, choices and conflicts; one stderr line when used;
    hidden from --help, whose entry for `new` names it as deprecated."""
    target = _action(parser, new)
    parser.add_argument(old, action=_DeprecatedFlag, target=target, new=new)
    _mention(target, f"Deprecated alias: {old}.")


def _mapped(prog: str, flag: str, aliases: Mapping[str, str],
            convert: Callable[[str], Any] | None) -> Callable[[str], Any]:
    def value(text: str) -> Any:
        if text in aliases:
            _warn(prog, f"{flag} {text}", f"{flag} {aliases[text]}")
            text = aliases[text]
        return convert(text) if convert is not None else text
    return value


def deprecated_values(parser: argparse.ArgumentParser, flag: str,
                      aliases: Mapping[str, str]) -> None:
    """Accept each old value of `aliases` for the already added `flag` as a deprecated
    spelling of its preferred value: parsed to the preferred one, with one stderr line.
    --help's choices stay the preferred ones; one sentence names the aliases."""
    target = _action(parser, flag)
    if target.choices is not None:
        unknown = sorted(set(aliases.values()) - set(target.choices))
        if unknown:
            raise ValueError(f"{flag}: aliases to values it does not take: {unknown}")
    target.type = _mapped(parser.prog, flag, aliases, target.type)  # type: ignore[arg-type]
    shown = ", ".join(f"{old} for {new}" for old, new in aliases.items())
    _mention(target, f"Deprecated alias{'es' if len(aliases) > 1 else ''}: {shown}.")
