"""The CPU meter (benchmarks/cpu_meter.py) on real processes: a tree whose child
burns CPU and exits (reaped by its parent) inside the window is charged what the
child itself measured with time.process_time(); a tree that sleeps is charged
nothing."""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks.cpu_meter import CpuMeter, CpuUse

# A parent that waits for a go line, then runs a child which burns `SECONDS` of
# CPU, reports process_time() and exits; the parent reaps it and echoes the report.
PARENT = """
import subprocess, sys
sys.stdin.readline()
child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
print(child.stdout.strip(), flush=True)
sys.stdin.readline()
"""
CHILD = (
    "import time\n"
    "while time.process_time() < SECONDS:\n"
    "    pass\n"
    "print(time.process_time())\n"
)


def _run_parent(seconds: float) -> tuple[float, float]:
    """The meter's charge for the parent's tree, and the child's own figure."""
    script = PARENT.replace("CHILD", repr(CHILD.replace("SECONDS", str(seconds))))
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        time.sleep(0.5)  # the parent is past its start, waiting for the go line
        meter = CpuMeter({"parent": proc.pid})
        before = meter.snapshot()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        child_seconds = float(proc.stdout.readline())
        used = meter.snapshot() - before
        proc.stdin.write("end\n")
        proc.stdin.flush()
    finally:
        proc.wait(timeout=60)
    return used.by_role["parent"], child_seconds


def test_a_reaped_childs_cpu_is_charged_to_its_tree() -> None:
    charged, child_seconds = _run_parent(1.0)
    assert child_seconds >= 1.0
    # /proc counts in clock ticks, sampled (it read 0.99 s for the child's 1.00 s
    # of process_time); above, the child's interpreter start and exit and the
    # parent's wait add a few tens of ms.
    assert 0.9 * child_seconds <= charged <= child_seconds + 0.5, (
        charged,
        child_seconds,
    )


def test_a_sleeping_tree_is_charged_nothing() -> None:
    """Negative control: the same tree around a sleeping process."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        meter = CpuMeter({"sleeper": proc.pid})
        before = meter.snapshot()
        time.sleep(1.0)
        assert (meter.snapshot() - before).total <= 0.02
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_meter_needs_a_root() -> None:
    try:
        CpuMeter({})
    except ValueError as error:
        assert "at least one root" in str(error)
    else:
        raise AssertionError("CpuMeter({}) was accepted")


# A process whose second thread polls without pause (hashing releases the GIL, as
# NIXL's C++ progress thread runs outside it) while its main thread waits.
POLLER = """
import hashlib, sys, threading
def poll():
    block = bytes(1 << 16)
    while True:
        hashlib.sha256(block).digest()
threading.Thread(target=poll, daemon=True).start()
sys.stdin.readline()
"""


def test_an_excluded_polling_thread_is_reported_apart() -> None:
    """The poller's seconds leave the role and appear as `excluded`; without the
    exclusion (the negative control) the role is charged them."""
    from tools.testbed.spinners import spinning_threads

    proc = subprocess.Popen([sys.executable, "-c", POLLER], stdin=subprocess.PIPE)
    try:
        time.sleep(0.5)
        pollers = spinning_threads([proc.pid], window_s=1.0, min_busy=0.05)
        assert len(pollers) == 1 and pollers[0].tid != proc.pid, pollers
        plain, excluding = CpuMeter({"p": proc.pid}), CpuMeter({"p": proc.pid}, pollers)
        before_plain, before_excluding = plain.snapshot(), excluding.snapshot()
        time.sleep(1.5)
        used_excluding = excluding.snapshot() - before_excluding
        used_plain = plain.snapshot() - before_plain
    finally:
        proc.kill()
        proc.wait(timeout=30)
    # The poller ran at least a fifth of the window, even sharing 2 cores.
    assert used_excluding.excluded >= 0.3, used_excluding
    assert used_excluding.total <= 0.05, used_excluding  # the main thread waits
    assert used_plain.total >= 0.3 and used_plain.excluded == 0.0, used_plain


def test_two_spans_add_role_by_role() -> None:
    """A span left out between two measured ones (r3_cost's prefix-cache reset): the
    sum has every role and process of either, each with both spans' seconds."""
    first = CpuUse({"server": 1.5}, {"server/engine": 1.0, "server/worker": 0.5}, 0.25)
    second = CpuUse({"server": 2.0, "front": 0.5}, {"server/engine": 2.0,
                                                   "front/router": 0.5}, 0.5)
    both = first + second
    assert both.by_role == {"server": 3.5, "front": 0.5}
    assert both.by_process == {"server/engine": 3.0, "server/worker": 0.5,
                               "front/router": 0.5}
    assert both.excluded == 0.75 and both.total == 4.0
