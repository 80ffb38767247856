"""The model runner hands a step's preemptions to the KV connector before it
updates its requests (patch handle-kv-connector-preemptions-before-the-runner).

KVConnectorBase_V1.handle_preemptions runs "before the blocks of preempted requests
are overwritten"; updating the runner's requests zeroes new blocks and applies the
step's copy-on-write copies. Each model runner that drives an ActiveKVConnector is
run on a stub instance up to its request update, around a real ActiveKVConnector
and a connector that records what it is asked, in order. Without the patch the
runner updates its requests first and the connector hears of the preemptions only
at pre_forward, so the recorded order is wrong.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from vllm.distributed.kv_transfer import kv_transfer_state

REQUEST_UPDATES = (
    "update_pp_decode_requests",
    "finish_requests",
    "free_states",
    "add_requests",
    "update_requests",
)


def runner_modules() -> list[tuple[str, str]]:
    """(runner module, its KV connector module) for each runner this vLLM has."""
    candidates = [
        ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu.kv_connector"),
        (
            "vllm.v1.worker.cpu.standalone_model_runner",
            "vllm.v1.worker.cpu.kv_connector",
        ),
    ]
    return [
        pair for pair in candidates if importlib.util.find_spec(pair[0]) is not None
    ]


class RecordingConnector:
    """The KV connector of a worker, as ActiveKVConnector uses it."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        pass

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        pass

    def handle_preemptions(self, metadata: str) -> None:
        self.events.append(f"preemptions of {metadata}")

    def bind_connector_metadata(self, metadata: str) -> None:
        self.events.append(f"bind {metadata}")


class StepStopped(Exception):
    """Raised by the stub runner once it has updated its requests."""


def step(metadata: str) -> SimpleNamespace:
    return SimpleNamespace(
        kv_connector_metadata=metadata,
        has_sync_kv_loads=False,
        total_num_scheduled_tokens=1,
    )


@pytest.fixture(params=runner_modules(), ids=lambda pair: pair[0].split(".")[-2])
def runner_and_connector(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> tuple[ModuleType, ModuleType, list[str]]:
    runner_module = importlib.import_module(request.param[0])
    connector_module = importlib.import_module(request.param[1])
    events: list[str] = []
    # set_disabled points the layer-wise hooks at the connector (or at None).
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    monkeypatch.setattr(
        connector_module, "get_kv_transfer_group", lambda: RecordingConnector(events)
    )
    return runner_module, connector_module, events


def stub_runner(runner_module: ModuleType, connector: Any, events: list[str]) -> Any:
    """A runner instance whose request updates record themselves; the last stops."""
    runner_class = next(
        value
        for name, value in vars(runner_module).items()
        if name.endswith("ModelRunner")
        and isinstance(value, type)
        and value.__module__ == runner_module.__name__
    )
    runner = object.__new__(runner_class)
    runner.kv_connector = connector
    runner.draft_tokens_handler = SimpleNamespace(begin_step=lambda output: None)

    def recorder(name: str):
        def update(*args: Any) -> None:
            events.append(name)
            if name == REQUEST_UPDATES[-1]:
                raise StepStopped

        return update

    for name in REQUEST_UPDATES:
        setattr(runner, name, recorder(name))
    return runner


def test_the_runner_hands_them_over_before_it_updates_its_requests(
    runner_and_connector: tuple[ModuleType, ModuleType, list[str]],
) -> None:
    runner_module, connector_module, events = runner_and_connector
    connector = connector_module.ActiveKVConnector(vllm_config=None, kv_caches_dict={})
    runner = stub_runner(runner_module, connector, events)
    with pytest.raises(StepStopped):
        runner.execute_model(step("step-1"))
    assert events == ["preemptions of step-1", *REQUEST_UPDATES]


def test_pre_forward_then_only_binds_the_step(
    runner_and_connector: tuple[ModuleType, ModuleType, list[str]],
) -> None:
    _, connector_module, events = runner_and_connector
    connector = connector_module.ActiveKVConnector(vllm_config=None, kv_caches_dict={})
    connector.handle_preemptions(step("step-1"))
    events.append("runner updates its requests")
    connector.pre_forward(step("step-1"))
    connector.handle_preemptions(step("step-2"))
    connector.pre_forward(step("step-2"))
    assert events == [
        "preemptions of step-1",
        "runner updates its requests",
        "bind step-1",
        "preemptions of step-2",
        "bind step-2",
    ]


def test_a_disabled_connector_is_not_asked(
    runner_and_connector: tuple[ModuleType, ModuleType, list[str]],
) -> None:
    _, connector_module, events = runner_and_connector
    connector = connector_module.ActiveKVConnector(vllm_config=None, kv_caches_dict={})
    connector.set_disabled(True)
    connector.handle_preemptions(step("step-1"))
    connector.pre_forward(step("step-1"))
    assert events == []
