# SPDX-License-Identifier: Apache-2.0
"""Counting instructions around a measured window only, with valgrind's callgrind:
a library of scheduler_step and offload_rows_limit_walk, not a script."""

from __future__ import annotations

import subprocess
from pathlib import Path


# Instruction counting: the child runs under `valgrind --tool=callgrind
# --instr-atstart=no`; a small shim (compiled here with gcc against valgrind's
# callgrind.h) switches instrumentation on around the measured steps only and
# dumps one profile per measurement, labelled with its name. Inside a step it stops
# counting while the stand-in worker builds the step's output (`cg_toggle`): that
# is the worker's work, not the scheduler's, and the fork's worker output carries
# one more field than stock's.
CALLGRIND_SHIM = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(const char *label) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(label); }
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""


def build_shim(workdir: Path) -> Path:
    source, library = workdir / "cg_shim.c", workdir / "cg_shim.so"
    source.write_text(CALLGRIND_SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source)],
                   check=True)
    return library


def callgrind_totals(outdir: Path) -> dict[str, int]:
    """Instructions of each labelled dump in `outdir` (label -> total)."""
    totals: dict[str, int] = {}
    for path in outdir.glob("cg.*"):
        label, total = None, None
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("desc: Trigger: Client Request: "):
                label = line.removeprefix("desc: Trigger: Client Request: ")
            elif line.startswith("totals: "):
                total = int(line.split()[1])
        if label and total is not None:
            totals[label] = total
    return totals
