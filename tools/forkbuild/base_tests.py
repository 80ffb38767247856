"""Which carried base runs which of the series' test files: its `prs.toml`.

Contract:
- A PR's test files (`tests` and `e2e_tests` in a base's `patches/prs.toml`) test
  that base's shape of the PR. A file some base lists runs on the bases that list
  it, and is left out of collection on the others (where upstream already does what
  the patch did on an older base, or does it differently, each base lists its own
  file; docs/bases.md says which).
- A file no base lists (the fork's tooling, testbed and harness tests) runs on
  every base.
- The test files themselves carry no base markers: they are what the PR sends
  upstream. Which base is installed comes from the installed vLLM's version.

Standard library only: `tests/conftest.py` imports it before anything else.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from functools import cache
from pathlib import Path

BASES_DIR = "bases"


def _release_of(pins: Path) -> str:
    with pins.open("rb") as f:
        return str(tomllib.load(f)["base"]["release"])


def _listed(prs_toml: Path) -> frozenset[str]:
    with prs_toml.open("rb") as f:
        plan = tomllib.load(f)
    return frozenset(path for pr in plan.get("pr", [])
                     for path in (*pr.get("tests", []), *pr.get("e2e_tests", [])))


@cache
def listed_by_base(root: Path) -> dict[str, frozenset[str]]:
    """Release -> the test files that base's PRs list (repository paths)."""
    bases = {_release_of(root / "pins.toml"): root}
    for pins in sorted((root / BASES_DIR).glob("*/pins.toml")):
        bases[pins.parent.name] = pins.parent
    return {release: _listed(base / "patches" / "prs.toml")
            for release, base in bases.items()}


def installed_release() -> str:
    """The base release of the installed vLLM (`0.34.0+r3...` -> `0.34.0`)."""
    return importlib.metadata.version("vllm").split("+")[0]


def other_bases_only(root: Path, release: str) -> frozenset[str]:
    """Test files another base lists and `release` does not: not collected there."""
    listed = listed_by_base(root)
    mine = listed.get(release, frozenset())
    return frozenset().union(*listed.values()) - mine
