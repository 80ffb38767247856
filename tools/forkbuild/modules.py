"""The fork's own modules: `vllm/` beside the patch series, one copy for every base.

Contract:
- `vllm/` at the repository root holds every file the fork adds to vLLM, at its
  path in vLLM's tree, as ordinary files. Every base ships them.
- `bases/<release>/vllm/` holds the few files that must differ on that carried
  base, whole; each is recorded with its reason in the base's
  `intended-differences.toml` (`[[module]]`, checked by `check-bases`).
- Patches edit files upstream ships, nothing else: a patch that creates a file,
  or touches a fork module, is refused; so is a module that shadows a file of
  the pinned base wheel (the fork would silently replace upstream's file).
- `prs.toml` names the PR that adds each module, whole (`modules`).

Failure policy: every refusal names the file and the fix; nothing is built
from a series that breaks the contract.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from . import BuildError
from .series import Patch

MODULES_DIR = "vllm"
# What the interpreter and tools leave beside sources; never part of the fork.
_IGNORED_PARTS = {"__pycache__"}
_IGNORED_SUFFIXES = {".pyc", ".pyo"}


def _files_under(directory: Path, prefix: Path) -> dict[str, Path]:
    """Every file under `directory` keyed by its path in vLLM's tree."""
    found: dict[str, Path] = {}
    if not directory.is_dir():
        return found
    for path in sorted(directory.rglob("*")):
        if not path.is_file() or path.suffix in _IGNORED_SUFFIXES:
            continue
        rel = path.relative_to(prefix)
        if _IGNORED_PARTS & set(rel.parts):
            continue
        found[rel.as_posix()] = path
    return found


def common_modules(root: Path) -> dict[str, Path]:
    """The modules every base ships: `vllm/` -> their files in this repository."""
    return _files_under(root / MODULES_DIR, root)


def override_modules(root: Path, base_dir: Path) -> dict[str, Path]:
    """A carried base's own versions (`bases/<release>/vllm/`); none for the primary
    base, whose directory is the repository root."""
    if base_dir.resolve() == root.resolve():
        return {}
    return _files_under(base_dir / MODULES_DIR, base_dir)


def fork_modules(root: Path, base_dir: Path) -> dict[str, Path]:
    """What one base ships: the common modules, with that base's overrides."""
    modules = common_modules(root)
    modules.update(override_modules(root, base_dir))
    return dict(sorted(modules.items()))


def shadowing_problems(modules: dict[str, Path], base_names: set[str],
                       base_label: str) -> list[str]:
    """Modules at a path the base wheel already has."""
    return [
        f"{source} would replace {path}, which {base_label} ships: the fork's modules "
        f"add files, they never shadow upstream's. Edit upstream's file with a patch "
        f"(python -m tools.fork checkout, commit, export) and remove {source}"
        for path, source in modules.items() if path in base_names
    ]


def patch_problems(patches: list[Patch], modules: dict[str, Path]) -> list[str]:
    """Patches that create a file or touch a fork module."""
    problems: list[str] = []
    for patch in patches:
        for diff in patch.files:
            if diff.old_path is None and diff.new_path is not None:
                problems.append(
                    f"{patch.name} creates {diff.new_path}: patches edit files upstream "
                    f"ships; put the new file at {diff.new_path} in this repository "
                    f"(the fork's vllm/ tree), name it in its PR's `modules` in "
                    f"prs.toml, and drop it from the patch")
            elif diff.path in modules:
                problems.append(
                    f"{patch.name} edits {diff.path}, which is the fork's own module "
                    f"{modules[diff.path]}: edit that file directly and drop the change "
                    f"from the patch")
    return problems


def require_contract(patches: list[Patch], modules: dict[str, Path],
                     base_names: set[str], base_label: str) -> None:
    """Refuse a series or modules that break the contract (module docstring)."""
    problems = patch_problems(patches, modules) + shadowing_problems(
        modules, base_names, base_label)
    if problems:
        raise BuildError("\n".join(problems))


def place_modules(tree: Path, modules: dict[str, Path]) -> None:
    """Copy `modules` into a tree of vLLM's sources at their paths."""
    for path, source in modules.items():
        target = tree / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
