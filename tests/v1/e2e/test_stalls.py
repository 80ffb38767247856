"""The harness's stall report (tools/testbed/stalls.py), on real processes: two
that never sleep, pinned to one core, each wait for it about half the time, and the
report names them with that wait; a sleeping one is not listed; a process blocked in
the kernel (state D) is listed with its kernel stack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.testbed.stalls import active_threads, blocked_threads, stall_report

# A process polling without pause on one core (a spinner), and one asleep. Each says
# "ready" once it is past the interpreter's start (which, on a loaded host, sleeps on
# reading its modules) and is about to spin or sleep.
SPIN = (
    "import os\nos.sched_setaffinity(0, {CORE})\nprint('ready', flush=True)\n"
    "while True:\n    pass\n"
)
SLEEP = "import time\nprint('ready', flush=True)\ntime.sleep(600)\n"


def _start(script: str) -> subprocess.Popen[str]:
    core = min(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", script.replace("CORE", str(core))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for proc in started:
            proc.kill()
            proc.wait(timeout=30)


def _active(pids: list[int], expected: set[int]) -> dict[int, Any]:
    """`active_threads` by pid, over up to three windows until it lists
    `expected`: on a loaded 2-core machine (make test serves beside this) one
    window can leave a runnable process below the share it needs."""
    for _ in range(3):
        found = {t.pid: t for t in active_threads(window_s=2.0, pids=pids)}
        if set(found) == expected:
            break
    return found


def test_spinners_sharing_a_core_are_listed_with_their_wait(
    processes: list[subprocess.Popen[str]],
) -> None:
    processes += [_start(SPIN), _start(SPIN), _start(SLEEP)]
    pids = [p.pid for p in processes]
    found = _active(pids, expected=set(pids[:2]))
    assert set(found) == set(pids[:2])
    for thread in found.values():
        # One core for two processes that never sleep: each ran and waited for about
        # half the window (other load on the core takes from both).
        assert thread.waited >= 0.3, thread
        assert thread.ran <= 0.7, thread
        assert thread.cpus == str(min(os.sched_getaffinity(0)))
    lines = (
        f"decode     pid {pids[0]} tid {pids[0]} 'python'",
        f"outside    pid {pids[1]} tid {pids[1]} 'python'",
    )
    # The report samples every thread on the host; as above, up to three windows.
    for _ in range(3):
        report = stall_report({pids[0]: "decode"}, window_s=2.0)
        if all(line in report for line in lines):
            break
    assert lines[0] in report, report
    assert lines[1] in report, report


def test_a_lone_spinner_is_listed_and_a_sleeper_is_not(
    processes: list[subprocess.Popen[str]],
) -> None:
    # Negative control: the sleeper is absent; the spinner is runnable (on a core or
    # waiting for one, as other load on the core decides) most of the window.
    processes += [_start(SPIN), _start(SLEEP)]
    found = _active([p.pid for p in processes], expected={processes[0].pid})
    assert set(found) == {processes[0].pid}
    spinner = found[processes[0].pid]
    assert spinner.ran + spinner.waited >= 0.5, spinner


# A parent that vfork()s waits, in state D, until its child execs or exits; this
# child sleeps first. The wait is killable, so the test can end it.
VFORK_C = """
#include <unistd.h>
int main(void) {
    if (vfork() == 0) { sleep(60); _exit(0); }
    return 0;
}
"""


def test_a_thread_blocked_in_the_kernel_is_listed_with_its_stack(tmp_path: Path) -> None:
    source = tmp_path / "vfork.c"
    source.write_text(VFORK_C)
    subprocess.run(["gcc", "-o", str(tmp_path / "vfork"), str(source)], check=True)
    # Its own process group, so that the vfork()ed child dies with it.
    proc = subprocess.Popen([str(tmp_path / "vfork")], process_group=0)
    try:
        deadline = time.monotonic() + 10
        while not (blocked := blocked_threads([proc.pid])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(t.pid, t.tid) for t, _ in blocked] == [(proc.pid, proc.pid)]
        if os.geteuid() == 0:  # kernel stacks are readable by root only
            assert "vfork" in blocked[0][1], blocked[0][1]
        report = stall_report({proc.pid: "prefill"}, window_s=0.5)
        assert f"prefill    pid {proc.pid} tid {proc.pid} 'vfork'" in report, report
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # Negative control: a sleeping process is not blocked.
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.2)
        assert blocked_threads([sleeper.pid]) == []
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
