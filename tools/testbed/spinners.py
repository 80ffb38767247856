"""Threads that stay busy while a deployment is idle, and lowering their priority.

Every NIXL agent runs a progress thread that polls without pause: nixl's Python
binding builds the agent with a poll delay of 0, and vLLM turns the thread on. One
agent alone took 5.0 CPU seconds in 5 s with nothing to do. A P/D pair with a TP = 2
decode has three, on a host with two cores. There the kernel kept running them while
a TP rank's output thread waited 120.9 s, runnable, on the same core, and decode's
engine core waited for that rank's answer (docs/deployment-shapes.md).

The harness finds the threads of a deployment that are busy while it serves nothing,
and sets them to nice 19. They still run whenever a core is free; they no longer
take a core from a thread that has work. That holds only among threads of one
session: with the kernel's autogroup on, sessions share a core equally whatever their
threads' nice values, so the servers run in the harness's session
(cpu_server.VllmServer). A process's main thread is never touched:
it runs the engine or the model. This is a measure for hosts with fewer cores than
engines. It changes only priorities, never what a server computes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

# CPU seconds per second that make an idle deployment's thread a spinner. At idle
# a thread that waits sleeps (0.00); a spinner sharing its core with two others
# still shows about 0.3.
MIN_BUSY = 0.15
WINDOW_S = 2.0
SPINNER_NICE = 19


@dataclass(frozen=True)
class SpinningThread:
    pid: int
    tid: int
    name: str
    busy: float  # CPU seconds per second over the window


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of `pid` other than its main thread: its name and its CPU
    seconds (user + system) so far. A process that is gone has none."""
    ticks = os.sysconf("SC_CLK_TCK")
    threads: dict[int, tuple[str, float]] = {}
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return threads
    for tid in tids:
        if tid == pid:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # Fields after the parenthesised name: state is the first, utime the 12th.
        fields = stat[stat.rindex(")") + 2:].split()
        threads[tid] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return threads


def spinning_threads(pids: Iterable[int], window_s: float = WINDOW_S,
                     min_busy: float = MIN_BUSY) -> list[SpinningThread]:
    """The non-main threads of `pids` that used at least `min_busy` CPU seconds per
    second over `window_s`. Call it while the processes serve nothing."""
    pids = list(pids)
    before = {pid: thread_cpu_seconds(pid) for pid in pids}
    time.sleep(window_s)
    found: list[SpinningThread] = []
    for pid in pids:
        for tid, (name, seconds) in thread_cpu_seconds(pid).items():
            if tid not in before[pid]:
                continue
            busy = (seconds - before[pid][tid][1]) / window_s
            if busy >= min_busy:
                found.append(SpinningThread(pid, tid, name, round(busy, 2)))
    return found


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant still alive."""
    try:
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def deprioritise(threads: Iterable[SpinningThread], nice: int = SPINNER_NICE) -> int:
    """Set each thread's nice value; return how many were set (a thread may be gone)."""
    done = 0
    for thread in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, thread.tid, nice)
            done += 1
        except (ProcessLookupError, PermissionError):
            continue
    return done
