"""The rows mirror belongs to its engine's auxiliary-output worker, which the model
runner hands to the KV connector before the connector registers its KV caches; a
hand-off never rewrites a slot another decode may be reading; and the fail-closed
checks are not `assert`s (patch `keep-routed-experts-rows-per-kv-block-in-a-mirror-a`).

Rows are distinguishable: row p holds the value p in every slot.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.dash_o import refused_under_dash_o
from tests.distributed.aux_output_connector.aux_worker_utils import (
    bare_worker,
    run_step,
)
from tests.distributed.aux_output_connector.rows_transfer_utils import (
    BS,
    PROMPT,
    SHAPE,
    fmt,
    rows,
)
from vllm.distributed.aux_output_connector.connector import (
    AuxOutputConnectorMetadata,
    PackedBlockHashes,
)
from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer
from vllm.distributed.aux_output_connector.rows_transfer import (
    RowsExport,
    RowsImport,
    RowsMirror,
    SlotCheck,
    block_token_chains,
    handed_rows_mirror,
    new_rows_mirror,
)


def engine_config(switch: bool = True) -> SimpleNamespace:
    """What new_rows_mirror reads of a VllmConfig: the switch and the format."""
    model = SimpleNamespace(
        get_total_num_hidden_layers=lambda: 3,
        get_num_experts_per_tok=lambda: 2,
        get_num_experts=lambda: 8,
    )
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(enable_routed_experts_transfer=switch),
        aux_output_config=SimpleNamespace(enabled=True),
        model_config=model,
        cache_config=SimpleNamespace(block_size=BS),
    )


# --- the mirror is handed over, never looked up --------------------------------------


def test_each_engine_worker_creates_its_own_mirror() -> None:
    first = new_rows_mirror(engine_config(), 16)
    second = new_rows_mirror(engine_config(), 24)  # another KV cache size
    assert first is not None and second is not None and first is not second
    assert (first.num_blocks, second.num_blocks) == (16, 24)
    # 3 layers x top-2 uint8 (8 experts) rows, block size 4.
    assert (first.format.num_layers, first.format.top_k) == (3, 2)
    assert first.format.dtype == "uint8" and first.format.block_size == BS


def test_no_mirror_without_the_switch() -> None:
    assert new_rows_mirror(engine_config(switch=False), 16) is None


def test_a_connector_moves_the_mirror_of_the_worker_handed_to_it() -> None:
    """Two engines in one process: each connector gets its own engine's mirror."""
    mirror_a, mirror_b = RowsMirror(fmt(), 16), RowsMirror(fmt(), 16)
    worker_a = SimpleNamespace(rows_mirror=mirror_a)
    worker_b = SimpleNamespace(rows_mirror=mirror_b)
    assert handed_rows_mirror(worker_a, 16, "NixlConnector") is mirror_a
    assert handed_rows_mirror(worker_b, 16, "NixlConnector") is mirror_b


@pytest.mark.parametrize("worker", [None, SimpleNamespace(rows_mirror=None)])
def test_a_connector_handed_no_mirror_fails_at_startup(worker) -> None:
    with pytest.raises(RuntimeError) as error:
        handed_rows_mirror(worker, 16, "OffloadingConnector")
    message = str(error.value)
    assert "enable_routed_experts_transfer" in message
    assert "OffloadingConnector was not handed" in message
    assert "set_aux_output_worker" in message
    assert "remove enable_routed_experts_transfer" in message


def test_a_mirror_of_another_size_is_refused() -> None:
    worker = SimpleNamespace(rows_mirror=RowsMirror(fmt(), 16))
    with pytest.raises(RuntimeError) as error:
        handed_rows_mirror(worker, 32, "MooncakeStoreConnector")
    message = str(error.value)
    assert "MooncakeStoreConnector has 32 KV blocks" in message
    assert "mirror of 16 slots" in message


class RecordingConnector:
    """A KV connector that records the model runner's calls, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def set_aux_output_worker(self, aux_output_worker: object) -> None:
        self.calls.append(("set_aux_output_worker", aux_output_worker))

    def register_kv_caches(self, kv_caches: dict) -> None:
        self.calls.append(("register_kv_caches", kv_caches))

    def set_host_xfer_buffer_ops(self, copy_operation: object) -> None:
        self.calls.append(("set_host_xfer_buffer_ops", copy_operation))


def test_the_model_runner_hands_the_worker_before_registering_kv_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NixlConnector registers the mirror's memory in register_kv_caches, so the
    worker must arrive first."""
    from vllm.v1.worker.gpu import kv_connector

    connector = RecordingConnector()
    monkeypatch.setattr(kv_connector, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_connector, "get_kv_transfer_group", lambda: connector)
    aux_worker, kv_caches = object(), {"layer.0": None}
    kv_connector.get_kv_connector(SimpleNamespace(), kv_caches, aux_worker)
    assert [name for name, _ in connector.calls] == [
        "set_aux_output_worker",
        "register_kv_caches",
        "set_host_xfer_buffer_ops",
    ]
    assert connector.calls[0][1] is aux_worker
    assert connector.calls[1][1] is kv_caches


def test_without_aux_output_no_worker_is_handed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.worker.gpu import kv_connector

    connector = RecordingConnector()
    monkeypatch.setattr(kv_connector, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_connector, "get_kv_transfer_group", lambda: connector)
    kv_connector.get_kv_connector(SimpleNamespace(), {})
    assert [name for name, _ in connector.calls] == [
        "register_kv_caches",
        "set_host_xfer_buffer_ops",
    ]


def test_a_multi_connector_hands_the_worker_to_every_child() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
    )

    children = [RecordingConnector(), RecordingConnector()]
    aux_worker = object()
    MultiConnector.set_aux_output_worker(
        SimpleNamespace(_connectors=children), aux_worker
    )
    assert [child.calls for child in children] == [
        [("set_aux_output_worker", aux_worker)]
    ] * 2


# --- a shared prefix slot's bytes never change under a read ---------------------------
#
# Hand-off 1 (rows from 0) wrote block 0's slot; its decode may be reading it when
# hand-off 2 of a prompt with the same first block but another
# routed_experts_prompt_start writes its rows. Before the fix hand-off 2 wrote
# [start, 4) and its tag, so hand-off 1's check (rows [0, 4)) failed: a spurious
# KV load error, HTTP 500 under kv_load_failure_policy=fail. Now every hand-off
# writes a block's rows from the block's start when the prefill has them, so the
# second write puts the same bytes.


def _export(mirror: RowsMirror, start: int) -> None:
    chains = tuple(block_token_chains(PROMPT, BS))
    mirror.write(
        RowsExport(start, 10, (5, 6, 7)[start // BS :], chains), rows(start, 10)
    )


def test_a_slot_of_other_tokens_is_written() -> None:
    """Negative control: a block id that now holds another prompt's block (the
    first lease ended) gets the new rows and tag."""
    mirror = RowsMirror(fmt(), num_blocks=8)
    _export(mirror, start=0)
    other = [99, *PROMPT[1:]]
    chains = tuple(block_token_chains(other, BS))
    mirror.write(RowsExport(0, 10, (5, 6, 7), chains), rows(0, 10) + 50)
    assert mirror.slot_problem(SlotCheck(5, chains[0], 0, BS)) is None
    np.testing.assert_array_equal(mirror.read(RowsImport(0, 4, (5,))), rows(0, 4) + 50)


def _prefill_worker(mirror: RowsMirror):
    worker = bare_worker(RoutedExpertsBuffer(np.dtype(np.uint8), SHAPE, BS, 2, 16, 2))
    worker._rows_mirror = mirror
    return worker


@pytest.mark.parametrize("prompt_start", [1, 2, 3, 5, 6])
def test_a_hand_off_writes_whole_blocks_whatever_its_prompt_start(
    prompt_start: int,
) -> None:
    """Prefill computed the whole prompt, so it has rows from 0: the slot of the
    block holding the prompt start gets the rows from that block's start, and
    two hand-offs with different starts write the same bytes (hand-off 1's
    check still passes after hand-off 2's write)."""
    slots = []
    for start in (0, prompt_start):
        mirror = RowsMirror(fmt(), num_blocks=8)
        worker = _prefill_worker(mirror)
        chains = tuple(block_token_chains(PROMPT, BS))
        export = RowsExport(start, 10, (5, 6, 7)[start // BS :], chains)
        hashes = {
            "p": PackedBlockHashes(b"".join(bytes([i]) * 32 for i in range(2)), 32)
        }
        metadata = AuxOutputConnectorMetadata(
            0, {"p": start}, hashes, (), rows_exports={"p": export}
        )
        run_step(worker, metadata, "p", 0, rows(0, 10))
        slots.append(mirror.slots.copy())
    first = prompt_start // BS
    # The slots the later hand-off writes (blocks from the one holding its start).
    np.testing.assert_array_equal(slots[0][5 + first :], slots[1][5 + first :])
    chains = block_token_chains(PROMPT, BS)
    assert mirror.slot_problem(SlotCheck(5 + first, chains[first], 0, BS)) is None
    np.testing.assert_array_equal(
        mirror.read(RowsImport(first * BS, 10, (5, 6, 7)[first:])), rows(first * BS, 10)
    )


# --- the fail-closed checks hold under python -O -------------------------------------


def test_fail_closed_checks_hold_under_python_dash_o() -> None:
    setup = """
        import numpy as np
        from vllm.distributed.aux_output_connector.rows_transfer import (
            RowsExport, RowsFormat, RowsImport, RowsMirror)
        mirror = RowsMirror(RowsFormat(3, 2, "uint8", 4), num_blocks=4)
    """
    calls = {
        "uncovered import": "mirror.read(RowsImport(0, 8, (1,)))",
        "short rows": (
            "mirror.write(RowsExport(0, 4, (1,), (7,)), np.zeros((3, 3, 2), np.uint8))"
        ),
    }
    assert refused_under_dash_o(setup, calls) == list(calls)
