# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KVConnectorBase_V1.set_aux_output_worker (patch
`hand-the-auxiliary-output-worker-to-the-kv-connector`): the model runner's KV
connector wrapper hands the engine's auxiliary-output worker to the KV connector
before the connector registers its KV caches, MultiConnector hands it to every
child, and the base hook does nothing."""

from types import SimpleNamespace

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.v1.worker.gpu import kv_connector as runner_kv_connector


class RecordingConnector:
    """The calls ActiveKVConnector makes on the KV connector, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def set_aux_output_worker(self, aux_output_worker: object) -> None:
        self.calls.append(("set_aux_output_worker", aux_output_worker))

    def register_kv_caches(self, kv_caches: object) -> None:
        self.calls.append(("register_kv_caches", kv_caches))

    def set_host_xfer_buffer_ops(self, copy_operation: object) -> None:
        self.calls.append(("set_host_xfer_buffer_ops", copy_operation))


@pytest.fixture
def recording_connector(monkeypatch: pytest.MonkeyPatch) -> RecordingConnector:
    connector = RecordingConnector()
    monkeypatch.setattr(runner_kv_connector, "get_kv_transfer_group", lambda: connector)
    return connector


def test_the_worker_is_handed_before_the_kv_caches_are_registered(
    recording_connector: RecordingConnector,
) -> None:
    worker, kv_caches = object(), {"layer.0": object()}

    runner_kv_connector.ActiveKVConnector(
        SimpleNamespace(), kv_caches, aux_output_worker=worker
    )

    names = [name for name, _ in recording_connector.calls]
    assert names == [
        "set_aux_output_worker",
        "register_kv_caches",
        "set_host_xfer_buffer_ops",
    ]
    assert recording_connector.calls[0][1] is worker
    assert recording_connector.calls[1][1] is kv_caches


def test_without_a_worker_the_hook_is_not_called(
    recording_connector: RecordingConnector,
) -> None:
    runner_kv_connector.ActiveKVConnector(SimpleNamespace(), {})

    names = [name for name, _ in recording_connector.calls]
    assert names == ["register_kv_caches", "set_host_xfer_buffer_ops"]


def test_multi_connector_hands_the_worker_to_every_child() -> None:
    children = [RecordingConnector(), RecordingConnector()]
    multi = SimpleNamespace(_connectors=children)
    worker = object()

    MultiConnector.set_aux_output_worker(multi, worker)

    for child in children:
        assert child.calls == [("set_aux_output_worker", worker)]


def test_the_base_hook_does_nothing() -> None:
    stand_in = SimpleNamespace()

    assert KVConnectorBase_V1.set_aux_output_worker(stand_in, object()) is None
    assert vars(stand_in) == {}
