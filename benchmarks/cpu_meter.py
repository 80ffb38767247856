"""CPU seconds (user + system) a deployment spends, read from /proc.

Wall clock on a shared 2-core machine measures the scheduler's mood: the same
request took 0.78 s to 30 s there. CPU time counts the work itself. A meter holds
named roots (an API server, a router, a proxy); a snapshot sums, over each root
and every live descendant, the process's own time and its reaped children's
(`utime + stime + cutime + cstime` of /proc/<pid>/stat). A child that exits and is
reaped during a window moves its time into its parent's `cutime`, so it is
counted once: engine cores, TP workers and helper processes all count, whether
they live through the window or not. Not counted: a process that leaves the tree
(reparented to init) and a root that exits during the window.

    meter = CpuMeter({"server": server_pid, "router": router_pid})
    before = meter.snapshot()
    ...  # the request set
    used = meter.snapshot() - before   # CpuUse: seconds per role, total

Threads that poll without pause (NIXL's progress threads, tools/testbed/spinners.py)
spend CPU in proportion to the wall clock, whatever the deployment does: one took a
core's worth at idle. Passed as `exclude`, their seconds are taken out of their
role and process and reported apart (`CpuUse.excluded`), so that a noisy wall clock
does not become a noisy CPU figure. A thread that exits during the window leaves its
seconds in its process's own time, where they are counted.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from tools.testbed.spinners import SpinningThread, process_tree, thread_cpu_seconds

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """One process's CPU seconds, its own and its reaped children's; 0 when it is
    gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    # Fields after the parenthesised name: state is field 3; utime, stime, cutime,
    # cstime are fields 14-17.
    fields = stat[stat.rindex(")") + 2 :].split()
    return sum(int(value) for value in fields[11:15]) / TICKS_PER_SECOND


def process_name(pid: int) -> str:
    """The name a process gave itself (vLLM's are VLLM::EngineCore,
    VLLM::Worker...: /proc/<pid>/comm, 15 characters); "?" when it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return "?"


@dataclass(frozen=True)
class CpuUse:
    """CPU seconds by role (each root's tree), and by process name within the
    roles ("role/name"): an engine core that polls its workers spends CPU while
    it waits, a worker while it computes."""

    by_role: dict[str, float]
    by_process: dict[str, float]
    excluded: float = 0.0  # seconds of the excluded threads (CpuMeter's `exclude`)

    @property
    def total(self) -> float:
        return sum(self.by_role.values())

    def __sub__(self, earlier: CpuUse) -> CpuUse:
        return CpuUse(
            {role: seconds - earlier.by_role.get(role, 0.0)
             for role, seconds in self.by_role.items()},
            {name: seconds - earlier.by_process.get(name, 0.0)
             for name, seconds in self.by_process.items()},
            self.excluded - earlier.excluded,
        )

    def __add__(self, other: CpuUse) -> CpuUse:
        """Two measured spans together (a span left out between them)."""
        return CpuUse(
            {role: self.by_role.get(role, 0.0) + other.by_role.get(role, 0.0)
             for role in {**self.by_role, **other.by_role}},
            {name: self.by_process.get(name, 0.0) + other.by_process.get(name, 0.0)
             for name in {**self.by_process, **other.by_process}},
            self.excluded + other.excluded,
        )


class CpuMeter:
    """CPU seconds of named process trees, without the `exclude` threads."""

    def __init__(self, roots: dict[str, int],
                 exclude: Iterable[SpinningThread] = ()) -> None:
        if not roots:
            raise ValueError("CpuMeter needs at least one root process")
        self.roots = dict(roots)
        self.exclude: dict[int, set[int]] = {}  # pid -> tids
        for thread in exclude:
            self.exclude.setdefault(thread.pid, set()).add(thread.tid)

    def _excluded_seconds(self, pid: int) -> float:
        tids = self.exclude.get(pid)
        if not tids:
            return 0.0
        return sum(seconds for tid, (_, seconds) in thread_cpu_seconds(pid).items()
                   if tid in tids)

    def snapshot(self) -> CpuUse:
        by_role: dict[str, float] = {}
        by_process: dict[str, float] = {}
        excluded = 0.0
        for role, root in self.roots.items():
            by_role[role] = 0.0
            for pid in process_tree(root):
                polling = self._excluded_seconds(pid)
                seconds = process_cpu_seconds(pid) - polling
                excluded += polling
                by_role[role] += seconds
                key = f"{role}/{process_name(pid)}"
                by_process[key] = by_process.get(key, 0.0) + seconds
        return CpuUse(by_role, by_process, excluded)
