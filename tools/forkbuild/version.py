"""The fork version: the base release plus a PEP 440 local label from our own git history.

    0.31.0+r3.2                      at tag `r3-2`, clean tree
    0.31.0+r3.2.dev5.g1a2b3c4        five commits after `r3-2`
    0.31.0+r3.0.dev17.g1a2b3c4.d20261130   no tag yet, uncommitted changes
    ... .cpu                         appended for the CPU base

The public part stays the upstream release, so anything that requires
`vllm==0.31.0` accepts the fork. The CPU base must carry `cpu` in its version:
vLLM picks its platform from that substring; the CUDA label never contains it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from . import BuildError

TAG_REGEX = r"^r3-(?P<version>\d+)$"
_LABEL = re.compile(r"^[a-z0-9]+(\.[a-z0-9]+)*$")


def _label_from_scm(scm: Any) -> str:
    number = scm.tag.release[0] if scm.tag.release else 0
    if str(scm.tag) == "0.0":  # setuptools-scm's stand-in when no r3-N tag exists
        number = 0
    label = f"r3.{number}"
    if scm.distance:
        label += f".dev{scm.distance}.{(scm.node or 'g0')[:8]}"
    if scm.dirty:
        label += f".d{scm.time:%Y%m%d}"
    return label


def fork_label(root: Path) -> str:
    """The local label, from `VLLM_FORK_LABEL` or from the repository's tags and commits."""
    override = os.environ.get("VLLM_FORK_LABEL")
    if override:
        label = override
    else:
        try:
            from setuptools_scm import get_version
        except ImportError:
            raise BuildError(
                "setuptools-scm is needed to derive the fork label: "
                "pip install setuptools-scm (or set VLLM_FORK_LABEL)"
            ) from None
        try:
            full = get_version(
                root=str(root),
                tag_regex=TAG_REGEX,
                version_scheme=lambda scm: "0",
                local_scheme=lambda scm: "+" + _label_from_scm(scm),
                git_describe_command=[
                    "git", "describe", "--dirty", "--tags", "--long", "--match", "r3-*",
                ],
            )
        except LookupError as exc:
            raise BuildError(
                f"cannot derive the fork label from {root} (not a git checkout?): "
                f"{exc}. Set VLLM_FORK_LABEL, e.g. VLLM_FORK_LABEL=r3.1"
            ) from None
        label = full.split("+", 1)[1]
    if not _LABEL.match(label) or "cpu" in label:
        raise BuildError(
            f"fork label {label!r} is not a PEP 440 local label of lowercase letters, "
            f"digits and dots, or contains 'cpu' (reserved for the CPU base)"
        )
    return label


def fork_version(release: str, label: str, variant: str) -> str:
    return f"{release}+{label}" + (".cpu" if variant == "cpu" else "")
