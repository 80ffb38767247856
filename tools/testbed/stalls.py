"""What every thread on the host is doing while a request is slow.

A P/D request on a 2-core host once waited 16 minutes for a TP rank's answer in CI,
and nobody was there to read `/proc` (docs/deployment-shapes.md). The harness calls
`stall_report` when a request has been waiting longer than STALL_REPORT_S and writes
it beside the servers' logs. Over a short window it reads, for every thread of every
process on the host, its CPU time and its run-queue wait (`/proc/<pid>/task/<tid>/
schedstat`), and lists the threads that either ran or waited for a core: a thread
that is runnable but not run shows a large wait, a spinner a large CPU share, and a
process outside the deployment (a leftover of an earlier test) is named as such.
Then every thread in uninterruptible sleep (state D), with its kernel stack.
Reading `/proc` this way never blocks on the process it reads, unlike `ps` or a
debugger attaching to a process whose memory lock is held.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

STALL_REPORT_S = 90.0
WINDOW_S = 2.0
# A thread is listed when it ran or waited for a core at least this share of the window.
MIN_SHARE = 0.05
MAX_FRAMES = 12  # of a blocked thread's kernel stack


@dataclass(frozen=True)
class ThreadSample:
    pid: int
    tid: int
    name: str
    state: str
    run_s: float  # CPU time so far (schedstat, nanoseconds → seconds)
    wait_s: float  # time runnable but waiting for a core so far


@dataclass(frozen=True)
class ThreadActivity:
    pid: int
    tid: int
    name: str
    state: str
    ran: float  # share of the window on a core
    waited: float  # share of the window runnable but not on a core
    wchan: str
    cpus: str  # the cores it may run on


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def sample_threads(pids: list[int]) -> dict[int, ThreadSample]:
    """Every thread of `pids` (gone processes and threads are skipped)."""
    samples: dict[int, ThreadSample] = {}
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except (FileNotFoundError, PermissionError):
            continue
        for tid in tids:
            stat = _read(f"/proc/{pid}/task/{tid}/stat")
            schedstat = _read(f"/proc/{pid}/task/{tid}/schedstat")
            if stat is None or schedstat is None:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            state = stat[stat.rindex(")") + 2:].split()[0]
            run_ns, wait_ns = (int(v) for v in schedstat.split()[:2])
            samples[tid] = ThreadSample(pid, tid, name, state, run_ns / 1e9, wait_ns / 1e9)
    return samples


def every_process() -> list[int]:
    """The pid of every process on the host."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cpus(tid: int) -> str:
    try:
        return ",".join(str(c) for c in sorted(os.sched_getaffinity(tid)))
    except OSError:
        return "?"


def active_threads(window_s: float = WINDOW_S, min_share: float = MIN_SHARE,
                   pids: list[int] | None = None) -> list[ThreadActivity]:
    """The threads of `pids` (default: every process on the host) that ran or waited
    for a core at least `min_share` of `window_s`, the longest waiters first."""
    if pids is None:
        pids = every_process()
    before = sample_threads(pids)
    time.sleep(window_s)
    after = sample_threads(pids)
    found: list[ThreadActivity] = []
    for tid, now in after.items():
        then = before.get(tid)
        if then is None:
            continue
        ran = (now.run_s - then.run_s) / window_s
        waited = (now.wait_s - then.wait_s) / window_s
        if max(ran, waited) < min_share:
            continue
        wchan = (_read(f"/proc/{now.pid}/task/{tid}/wchan") or "").strip() or "-"
        found.append(ThreadActivity(now.pid, tid, now.name, now.state, round(ran, 2),
                                    round(waited, 2), wchan, _cpus(tid)))
    return sorted(found, key=lambda t: (-t.waited, -t.ran))


def blocked_threads(pids: list[int] | None = None) -> list[tuple[ThreadSample, str]]:
    """The threads of `pids` (default: every process) in uninterruptible sleep
    (state D), each with its kernel stack (`/proc/<pid>/task/<tid>/stack`, readable
    by root; "" otherwise). Such a thread neither runs nor waits for a core, so
    active_threads cannot see it, and its process cannot die until it wakes."""
    if pids is None:
        pids = every_process()
    blocked = []
    for sample in sample_threads(pids).values():
        if sample.state == "D":
            stack = _read(f"/proc/{sample.pid}/task/{sample.tid}/stack") or ""
            frames = [line.split("] ", 1)[-1] for line in stack.splitlines()]
            blocked.append((sample, " < ".join(frames[:MAX_FRAMES])))
    return blocked


def stall_report(owner: dict[int, str], window_s: float = WINDOW_S) -> str:
    """One line per thread on the host that ran or waited for a core during the
    window; `owner` names the deployment's processes (pid → server name), any other
    process is "outside"."""
    lines = [f"threads that ran or waited for a core during {window_s:.0f} s "
             "(share of the window; waited = runnable but not on a core):"]
    for t in active_threads(window_s):
        lines.append(f"  {owner.get(t.pid, 'outside'):10} pid {t.pid} tid {t.tid} "
                     f"{t.name!r} state {t.state} ran {t.ran:.2f} waited {t.waited:.2f} "
                     f"cpus {t.cpus} wchan {t.wchan}")
    if len(lines) == 1:
        lines.append("  none")
    lines.append("threads in uninterruptible sleep (state D), with their kernel stacks:")
    blocked = blocked_threads()
    for t, stack in blocked:
        lines.append(f"  {owner.get(t.pid, 'outside'):10} pid {t.pid} tid {t.tid} "
                     f"{t.name!r}: {stack or '(stack not readable)'}")
    if not blocked:
        lines.append("  none")
    return "\n".join(lines)
