"""Model Runner V2 hands a step's preemptions to the KV connector before the runner
updates its requests (patch handle-kv-connector-preemptions-before-the-runner).

A real ActiveKVConnector around a connector that records what it is asked, in
order: the runner's early call (handle_preemptions) reaches the connector once, and
pre_forward then only binds the metadata; without the early call pre_forward hands
the preemptions over itself, as before; once per step either way.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm.v1.worker.gpu import kv_connector as runner_kv_connector
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector


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


def step(metadata: str) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_metadata=metadata, has_sync_kv_loads=False)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    recorded: list[str] = []
    monkeypatch.setattr(
        runner_kv_connector,
        "get_kv_transfer_group",
        lambda: RecordingConnector(recorded),
    )
    return recorded


def test_the_early_call_hands_them_over_once_before_the_step(
    events: list[str],
) -> None:
    connector = ActiveKVConnector(vllm_config=None, kv_caches_dict={})
    connector.handle_preemptions(step("step-1"))
    events.append("runner updates its requests")
    connector.pre_forward(step("step-1"))
    assert events == [
        "preemptions of step-1",
        "runner updates its requests",
        "bind step-1",
    ]


def test_without_the_early_call_pre_forward_hands_them_over(
    events: list[str],
) -> None:
    connector = ActiveKVConnector(vllm_config=None, kv_caches_dict={})
    connector.handle_preemptions(step("step-1"))
    connector.pre_forward(step("step-1"))
    connector.pre_forward(step("step-2"))  # a step whose runner did not call early
    assert events == [
        "preemptions of step-1",
        "bind step-1",
        "preemptions of step-2",
        "bind step-2",
    ]


def test_a_disabled_connector_is_not_asked(events: list[str]) -> None:
    connector = ActiveKVConnector(vllm_config=None, kv_caches_dict={})
    connector.set_disabled(True)
    connector.handle_preemptions(step("step-1"))
    connector.pre_forward(step("step-1"))
    assert events == []


def test_a_lost_early_call_is_caught(events: list[str]) -> None:
    """Negative control: if pre_forward forgot that the early call happened, the
    connector would be asked twice in one step; the first test's check fails."""
    connector = ActiveKVConnector(vllm_config=None, kv_caches_dict={})
    connector.handle_preemptions(step("step-1"))
    connector._preemptions_handled = False  # the planted fault
    connector.pre_forward(step("step-1"))
    assert events.count("preemptions of step-1") == 2
    assert events != ["preemptions of step-1", "bind step-1"]
