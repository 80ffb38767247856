"""Stopping a deployment (tools/testbed/cpu_server.py, tools/e2e/harness.py): a
server still alive after SIGKILL is reported by name with its kernel state and
fails its group's scenarios, and the harness still prints what it checked. A CI
run once lost its whole table to a prefill server that took more than 30 s to exit
after SIGKILL (docs/deployment-shapes.md, "TP = 2 in make test")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tools.e2e import harness
from tools.e2e.cluster_spec import ClusterSpec
from tools.e2e.scenarios import Req, Scenario
from tools.testbed import cpu_server
from tools.testbed.cpu_server import ProcessOutlivedKill, stop_process_group

# Ignores SIGTERM, as a server waiting on a hung request does.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "print('ready', flush=True); time.sleep(600)"


def _stubborn() -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process


def test_a_process_ignoring_sigterm_is_killed_and_nothing_is_raised() -> None:
    process = _stubborn()
    stop_process_group(process, grace=0.5, kill_wait=30)
    assert process.returncode == -signal.SIGKILL


def test_a_process_outliving_sigkill_is_named_with_its_kernel_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    process = _stubborn()
    delivered: list[int] = []
    real_killpg = os.killpg

    def killpg_losing_sigkill(pgid: int, sig: int) -> None:
        # Planted: the kill is "sent" but the process stays, as one stuck in the
        # kernel would.
        delivered.append(sig)
        if sig != signal.SIGKILL:
            real_killpg(pgid, sig)

    monkeypatch.setattr(cpu_server.os, "killpg", killpg_losing_sigkill)
    try:
        with pytest.raises(ProcessOutlivedKill) as raised:
            stop_process_group(process, grace=0.5, kill_wait=0.5)
        assert delivered == [signal.SIGTERM, signal.SIGKILL]
        message = str(raised.value)
        assert f"process {process.pid} still alive 0 s after SIGKILL" in message
        assert "state sleeping, wchan " in message
    finally:
        monkeypatch.undo()
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


class _Server:
    url = "http://server"


class _ClusterOutlivingStop:
    """Starts, serves and then fails to stop, as Cluster.stop does when a server
    outlives SIGKILL."""

    def __init__(self, spec: Any, logs: Path) -> None:
        self.servers = {"prefill": _Server(), "decode": _Server()}
        self.proxy_process = None
        self.restarts = 0

    def start(self) -> float:
        return 1.0

    def stop(self) -> None:
        raise ProcessOutlivedKill("prefill: process 4242 still alive 180 s after SIGKILL "
                                  "(state disk-sleep, wchan exit_mmap)")


def test_a_deployment_that_did_not_stop_fails_its_scenarios_and_keeps_its_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    scenarios = [Scenario("a", "pd", (Req(5),)), Scenario("b", "pd", (Req(7),))]
    monkeypatch.setattr(harness, "Cluster", _ClusterOutlivingStop)
    monkeypatch.setattr(harness, "cluster_spec", lambda *args: ClusterSpec(tmp_path))
    monkeypatch.setattr(harness, "run_scenario",
                        lambda cluster, scenario: harness.Result(scenario))
    results = harness.run_group("pd", scenarios, {}, None, tmp_path)  # type: ignore[arg-type]
    assert [r.mismatches for r in results] == [1, 1]
    assert harness.print_report(results, 1.0, None) == 1
    out = capsys.readouterr().out
    assert "e2e: deployment 'pd' did not stop: prefill: process 4242" in out
    assert "  a: the deployment did not stop: prefill: process 4242" in out
    assert "e2e: 2 scenarios, 2 mismatches" in out


def test_a_deployment_that_stopped_fails_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Negative control of the test above: the same run with a clean stop passes.
    monkeypatch.setattr(_ClusterOutlivingStop, "stop", lambda self: None)
    monkeypatch.setattr(harness, "Cluster", _ClusterOutlivingStop)
    monkeypatch.setattr(harness, "cluster_spec", lambda *args: ClusterSpec(tmp_path))
    monkeypatch.setattr(harness, "run_scenario",
                        lambda cluster, scenario: harness.Result(scenario))
    results = harness.run_group("pd", [Scenario("a", "pd", (Req(5),))], {}, None,  # type: ignore[arg-type]
                                tmp_path)
    assert [r.mismatches for r in results] == [0]
