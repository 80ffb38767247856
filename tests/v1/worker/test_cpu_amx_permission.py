"""The CPU worker asks for the AMX tile data state before its first forward.

Linux raises SIGILL on the first AMX tile instruction of a process that has not
requested the tile data state; vLLM's own AMX kernels do not request it, so a CPU
worker whose first forward was 1-2 tokens died on Sapphire Rapids class machines
(the request happened only as a side effect of a larger oneDNN GEMM). This machine
has no AMX, so the tests replace torch's probes: what is checked is that the
request is made exactly when the CPU has AMX, before the worker builds its model
runner, and that a refusal is reported.
"""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap
from unittest.mock import MagicMock

import pytest
import torch

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_worker import request_amx_tile_permission


@pytest.mark.parametrize(
    ("has_amx", "granted", "expected"),
    [(False, None, False), (True, True, True), (True, False, False)],
)
def test_requests_the_tile_state_only_on_amx_cpus(
    monkeypatch: pytest.MonkeyPatch, has_amx: bool, granted: bool | None, expected: bool
) -> None:
    init_amx = MagicMock(return_value=granted)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: has_amx)
    monkeypatch.setattr(torch.cpu, "_init_amx", init_amx)
    assert request_amx_tile_permission() is expected
    assert init_amx.call_count == int(has_amx)


def test_a_refusal_is_logged_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False)
    monkeypatch.setattr(cpu_worker.logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger=cpu_worker.logger.name):
        request_amx_tile_permission()
    assert "SIGILL" in caplog.text and "Linux 5.16" in caplog.text


def test_init_device_requests_it_before_building_the_model_runner() -> None:
    """Order in CPUWorker.init_device: the request precedes the first statement
    that constructs a model runner (no kernel can run before it)."""
    source = textwrap.dedent(inspect.getsource(cpu_worker.CPUWorker.init_device))
    calls = [
        (node.lineno, ast.unparse(node.func))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
    ]
    request = [line for line, name in calls if name == "request_amx_tile_permission"]
    runners = [
        line
        for line, name in calls
        if name.endswith(("ModelRunnerV2", "CPUModelRunner"))
    ]
    assert len(request) == 1 and runners and request[0] < min(runners)
