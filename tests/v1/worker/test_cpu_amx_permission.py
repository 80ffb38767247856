"""The CPU worker asks for the AMX tile data state before its first forward.

Linux raises SIGILL on the first AMX tile instruction of a process that has not
requested the tile data state; vLLM's own AMX kernels do not request it, so a CPU
worker whose first forward was 1-2 tokens died on Sapphire Rapids class machines
(the request happened only as a side effect of a larger oneDNN GEMM). This machine
has no AMX, so the tests replace torch's probes: what is checked is that the
request is made exactly when the CPU has AMX, that a refusal is reported, and, by
running CPUWorker.init_device with recording stand-ins for its collaborators, that
the request comes before the distributed init and the model runner.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu import model_runner as cpu_model_runner_v2
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


ORDER = ["amx tile request", "distributed init", "model runner"]


class _Stop(Exception):
    """Raised by the stand-in model runner: init_device stops there."""


def _init_device_events(monkeypatch: pytest.MonkeyPatch, use_v2: bool) -> list[str]:
    """Run CPUWorker.init_device with its collaborators recording what they are
    asked, in order, until it constructs its model runner."""
    events: list[str] = []

    def runner(*args: object) -> None:
        events.append("model runner")
        raise _Stop

    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)
    monkeypatch.setattr(
        cpu_worker,
        "request_amx_tile_permission",
        lambda: events.append("amx tile request"),
    )
    monkeypatch.setattr(
        cpu_worker,
        "init_worker_distributed_environment",
        lambda *args: events.append("distributed init"),
    )
    monkeypatch.setattr(cpu_worker, "set_random_seed", lambda seed: None)
    monkeypatch.setattr(cpu_worker, "CPUModelRunner", runner)
    monkeypatch.setattr(cpu_model_runner_v2, "CPUModelRunner", runner)
    monkeypatch.setenv("LD_PRELOAD", "libtcmalloc libiomp")  # no warnings
    worker = object.__new__(cpu_worker.CPUWorker)  # only what init_device reads
    worker.vllm_config = SimpleNamespace(speculative_config=None)
    worker.model_config = SimpleNamespace(seed=0)
    worker.distributed_init_method = "tcp://127.0.0.1:29500"
    worker.rank = worker.local_rank = 0
    worker.use_v2_model_runner = use_v2
    with pytest.raises(_Stop):
        worker.init_device()
    return events


@pytest.mark.parametrize("use_v2", [True, False])
def test_init_device_requests_it_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, use_v2: bool
) -> None:
    """The request comes first: before the distributed init and before the
    model runner (no kernel can run before it), with either model runner. A
    worker that never asks records no request, and the order differs."""
    assert _init_device_events(monkeypatch, use_v2) == ORDER
