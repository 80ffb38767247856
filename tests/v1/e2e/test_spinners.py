"""The harness's spinner finder (tools/testbed/spinners.py), on a real process: a
thread that polls without pause is found and set to nice 19; a thread that sleeps
and the main thread (even busy) are not."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tools.testbed.spinners import (
    MIN_BUSY,
    deprioritise,
    process_tree,
    spinning_threads,
)

# A busy main thread, one thread polling without pause (as NIXL's progress thread
# does) and one waiting; the main thread prints their native ids. Both busy threads
# burn their CPU in hashing, which releases the GIL (as NIXL's C++ thread runs
# outside it): a pure-Python loop would share the GIL with the main thread, and on a
# loaded host the spinner's share of it could fall below any threshold.
SCRIPT = """
import hashlib, threading, time
BLOB = bytes(1 << 22)
ids = {}
def busy():
    while True:
        hashlib.sha256(BLOB).digest()
def spin():
    ids["spin"] = threading.get_native_id()
    busy()
def wait():
    ids["wait"] = threading.get_native_id()
    time.sleep(600)
for target in (spin, wait):
    threading.Thread(target=target, daemon=True).start()
while len(ids) < NUM_THREADS:
    time.sleep(0.01)
# One line from one thread: two threads' prints may interleave.
print(" ".join(f"{name}={tid}" for name, tid in ids.items()), flush=True)
busy()
"""


@pytest.fixture
def process() -> Iterator[tuple[subprocess.Popen[str], dict[str, int]]]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.replace("NUM_THREADS", "2")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    tids = dict(pair.split("=") for pair in proc.stdout.readline().split())
    try:
        yield proc, {name: int(tid) for name, tid in tids.items()}
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_the_spinning_thread_is_found_and_set_to_nice_19(
    process: tuple[subprocess.Popen[str], dict[str, int]],
) -> None:
    proc, tids = process
    # Up to three windows, at a third of the harness's threshold: on a loaded
    # 2-core machine a window can give the spinner less than MIN_BUSY of a core.
    # The waiting thread uses no CPU at all, so the lower bar still tells them apart.
    for _ in range(3):
        found = spinning_threads(process_tree(proc.pid), window_s=2.0,
                                 min_busy=MIN_BUSY / 3)
        if found:
            break
    assert [(t.pid, t.tid) for t in found] == [(proc.pid, tids["spin"])]
    assert found[0].busy >= MIN_BUSY / 3
    assert deprioritise(found) == 1
    assert os.getpriority(os.PRIO_PROCESS, tids["spin"]) == 19
    # The waiting thread keeps the niceness it inherited (this process's: 0 unless
    # the suite itself runs under nice).
    assert os.getpriority(os.PRIO_PROCESS, tids["wait"]) == os.getpriority(
        os.PRIO_PROCESS, 0)


def test_a_process_whose_threads_wait_has_no_spinner() -> None:
    # Negative control: the same process without the spinning thread.
    script = SCRIPT.replace("for target in (spin, wait):", "for target in (wait,):")
    script = script.replace("NUM_THREADS", "1")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("wait=")
        assert spinning_threads(process_tree(proc.pid), window_s=1.0,
                                min_busy=MIN_BUSY / 3) == []
    finally:
        proc.kill()
        proc.wait(timeout=30)
