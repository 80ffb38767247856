"""git in a working tree of vLLM's sources, with a fixed identity where bytes must
not depend on the machine (the checkout's base commit, exported PR patches)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from . import BuildError

# A fixed identity and date make a commit, and so every exported `index` line, the
# same on every machine.
FIXED_IDENTITY = {
    "GIT_AUTHOR_NAME": "vLLM upstream",
    "GIT_AUTHOR_EMAIL": "upstream@vllm.invalid",
    "GIT_COMMITTER_NAME": "vLLM upstream",
    "GIT_COMMITTER_EMAIL": "upstream@vllm.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+00:00",
}


def git(tree: Path, *args: str, env: dict[str, str] | None = None,
        stdin: str | None = None) -> str:
    """Run git in `tree` (never in an enclosing repository); its stdout, or a
    BuildError quoting git."""
    full_env = dict(os.environ)
    full_env["GIT_CEILING_DIRECTORIES"] = str(tree.resolve().parent)
    full_env.update(env or {})
    result = subprocess.run(
        ["git", "-C", str(tree), *args], env=full_env, capture_output=True, text=True,
        input=stdin,
    )
    if result.returncode != 0:
        raise BuildError(f"git {' '.join(args)} failed in {tree}:\n{result.stderr.strip()}")
    return result.stdout
