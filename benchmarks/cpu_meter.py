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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tools.testbed.spinners import process_tree

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

    @property
    def total(self) -> float:
        return sum(self.by_role.values())

    def __sub__(self, earlier: CpuUse) -> CpuUse:
        return CpuUse(
            {role: seconds - earlier.by_role.get(role, 0.0)
             for role, seconds in self.by_role.items()},
            {name: seconds - earlier.by_process.get(name, 0.0)
             for name, seconds in self.by_process.items()},
        )


class CpuMeter:
    """CPU seconds of named process trees."""

    def __init__(self, roots: dict[str, int]) -> None:
        if not roots:
            raise ValueError("CpuMeter needs at least one root process")
        self.roots = dict(roots)

    def snapshot(self) -> CpuUse:
        by_role: dict[str, float] = {}
        by_process: dict[str, float] = {}
        for role, root in self.roots.items():
            by_role[role] = 0.0
            for pid in process_tree(root):
                seconds = process_cpu_seconds(pid)
                by_role[role] += seconds
                key = f"{role}/{process_name(pid)}"
                by_process[key] = by_process.get(key, 0.0) + seconds
        return CpuUse(by_role, by_process)
