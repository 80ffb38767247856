"""The rows-path tally (benchmarks/rows_tally.py): functions wrapped after import,
thread CPU per call, one file per process, forked children counted apart, and the
functions a vLLM lacks named, on stand-in modules; then in real processes started
the way a server is (its sitecustomize on PYTHONPATH)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

from benchmarks import rows_tally
from benchmarks.rows_tally import Tally, read_tally, tally_env, wrap_module


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_wrapped_function_counts_its_calls_and_cpu(monkeypatch) -> None:
    monkeypatch.setattr(rows_tally, "_COUNTERS", rows_tally._Counters())
    module = types.ModuleType("stand_in")

    class Mirror:
        def read(self, seconds: float) -> str:
            spin(seconds)
            return "rows"

    module.Mirror = Mirror  # type: ignore[attr-defined]
    module.idle = lambda: time.sleep(0.05)  # type: ignore[attr-defined]
    wrap_module(module, ["Mirror.read", "idle", "Mirror.gone"])
    assert Mirror().read(0.02) == "rows" and Mirror().read(0.03) == "rows"
    module.idle()  # type: ignore[attr-defined]
    counters = rows_tally._COUNTERS
    assert counters.calls == {"stand_in:Mirror.read": 2, "stand_in:idle": 1}
    assert 0.05 <= counters.seconds["stand_in:Mirror.read"] < 0.5
    # Thread CPU, not wall: 50 ms of sleep costs next to nothing.
    assert counters.seconds["stand_in:idle"] < 0.01
    assert counters.missing == {"stand_in:Mirror.gone"}


def test_tallies_add_and_subtract_per_function() -> None:
    earlier = Tally({"m:f": 1.0}, {"m:f": 2})
    later = Tally({"m:f": 1.5, "m:g": 0.25}, {"m:f": 3, "m:g": 1}, {"m:h"})
    assert (later - earlier) == Tally({"m:f": 0.5, "m:g": 0.25}, {"m:f": 1, "m:g": 1},
                                      {"m:h"})
    assert (earlier + earlier).calls == {"m:f": 4}


def test_the_files_of_every_process_are_summed(tmp_path: Path) -> None:
    for pid, seconds in ((11, 0.5), (12, 0.25)):
        (tmp_path / f"{pid}.json").write_text(json.dumps(
            {"seconds": {"m:f": seconds}, "calls": {"m:f": 1}, "missing": []}))
    (tmp_path / ".13.tmp").write_text("{half written")
    assert read_tally(tmp_path) == Tally({"m:f": 0.75}, {"m:f": 2}, set())


CHILD = """
import os, sys, time
from vllm.utils import serial_utils  # imported after the tally is installed
import numpy as np
serial_utils.numpy2base64(np.zeros((4, 2, 2), np.uint8))
if os.fork() == 0:
    serial_utils.numpy2base64(np.zeros((4, 2, 2), np.uint8))
    serial_utils.numpy2base64(np.zeros((4, 2, 2), np.uint8))
    time.sleep(1.0)
    os._exit(0)
os.wait()
time.sleep(1.0)
print(os.getpid())
"""


def test_a_server_process_tallies_through_its_sitecustomize(tmp_path: Path) -> None:
    """A Python started with `tally_env` times a function of vLLM it imports; a
    forked child writes its own file, starting from zero."""
    env = {**os.environ, **tally_env(tmp_path)}
    parent = int(subprocess.run([sys.executable, "-c", CHILD], env=env, check=True,
                                capture_output=True, text=True).stdout)
    files = {int(p.stem): json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    key = "vllm.utils.serial_utils:numpy2base64"
    assert files[parent]["calls"] == {key: 1}
    [child] = set(files) - {parent}
    assert files[child]["calls"] == {key: 2}
    assert read_tally(tmp_path).calls == {key: 3}


def test_without_the_environment_nothing_is_tallied(tmp_path: Path) -> None:
    """Negative control: the same process without R3_TALLY_DIR writes nothing."""
    env = {**os.environ, "PYTHONPATH": tally_env(tmp_path)["PYTHONPATH"]}
    env.pop(rows_tally.ENV, None)
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True,
                   capture_output=True)
    assert list(tmp_path.iterdir()) == []


def test_every_tallied_function_exists_in_this_vllm() -> None:
    """The names in TALLIED are this fork's (a rename would make the tally quietly
    miss a component); pdproxy's merge is in its own package."""
    import importlib

    for module_name, functions in rows_tally.TALLIED.items():
        module = importlib.import_module(module_name)
        for name, _ in functions:
            owner = module
            for part in name.split("."):
                owner = getattr(owner, part)
            assert callable(owner), f"{module_name}:{name}"

