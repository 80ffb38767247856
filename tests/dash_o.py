"""Run checks under ``python -O``, where ``assert`` statements are gone, for tests
that a fail-closed check is explicit (it raises) rather than an assert."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def refused_under_dash_o(setup: str, calls: dict[str, str]) -> list[str]:
    """The names of ``calls`` (name -> one Python expression, evaluated after
    ``setup``) that raise ``ValueError`` in a ``python -O`` interpreter."""
    script = "\n".join(
        [
            "import json",
            textwrap.dedent(setup),
            "refused = []",
            f"for name, expression in {json.dumps(calls)}.items():",
            "    try:",
            "        eval(expression)",
            "    except ValueError:",
            "        refused.append(name)",
            "print(json.dumps(refused))",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", script], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"python -O failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def json_under_dash_o(test_file: str, function: str) -> object:
    """What ``function()`` of the test module ``test_file`` returns when called
    in a ``python -O`` interpreter, through JSON (tuples become lists)."""
    here, module = os.path.split(os.path.abspath(test_file))
    script = "\n".join(
        [
            "import json, sys",
            f"sys.path[:0] = [{here!r}]",
            f"from {module.removesuffix('.py')} import {function}",
            f"print(json.dumps({function}()))",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", script], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"python -O failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
