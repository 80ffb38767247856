"""Skipping the partially computed first block (patch
`skip-the-partially-computed-first-block-when`).

Rows are distinguishable: row p holds the value p in every slot, so a staged
or published block shows exactly which positions it carries.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.aux_output_connector.aux_worker_utils import (
    bare_worker,
    run_step,
)
from vllm.distributed.aux_output_connector.connector import (
    AuxOutputConnectorMetadata,
    AuxRequestOutput,
    PackedBlockHashes,
)
from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector

SHAPE = (3, 2)  # (layers, top_k)
BS = 4


def rows(start: int, end: int) -> np.ndarray:
    return np.broadcast_to(
        np.arange(start, end, dtype=np.uint8)[:, None, None], (end - start, *SHAPE)
    ).copy()


def new_buffer() -> RoutedExpertsBuffer:
    return RoutedExpertsBuffer(np.dtype(np.uint8), SHAPE, BS, 1, 8, 2)


def test_reference_sequence_first_forward_at_6() -> None:
    buffer = new_buffer()
    buffer.skip_partial_first_block("r", 6)
    assert buffer.capture("r", 6, rows(6, 7)) == []
    assert buffer.capture("r", 7, rows(7, 9)) == []  # 7 dropped, 8 staged
    [(start, block)] = buffer.capture("r", 9, rows(9, 12))
    assert start == 8
    np.testing.assert_array_equal(block, rows(8, 12))


@pytest.mark.parametrize("first", range(BS * 2 + 1, BS * 3))  # every mid-block offset
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_every_offset_publishes_only_full_later_blocks(first: int, chunk: int) -> None:
    buffer = new_buffer()
    buffer.skip_partial_first_block("r", first)
    published: list[tuple[int, np.ndarray]] = []
    position = first
    while position < 20:
        end = min(position + chunk, 20)
        published += [
            (s, b.copy()) for s, b in buffer.capture("r", position, rows(position, end))
        ]
        position = end
    starts = [s for s, _ in published]
    assert starts == [12, 16]  # block 8 (holding `first`) is never published
    for start, block in published:
        np.testing.assert_array_equal(block, rows(start, start + BS))


def test_aligned_first_capture_is_not_skipped() -> None:
    buffer = new_buffer()
    buffer.skip_partial_first_block("r", 8)  # on a boundary: nothing to skip
    [(start, _)] = buffer.capture("r", 8, rows(8, 12))
    assert start == 8


def test_without_the_skip_an_unaligned_first_capture_still_fails_closed() -> None:
    buffer = new_buffer()
    with pytest.raises(AssertionError, match="capture is not contiguous"):
        buffer.capture("r", 6, rows(6, 7))


def test_discard_and_reset_forget_the_skip() -> None:
    buffer = new_buffer()
    buffer.skip_partial_first_block("r", 6)
    buffer.discard("r")
    with pytest.raises(AssertionError, match="not contiguous"):
        buffer.capture("r", 6, rows(6, 7))
    buffer = new_buffer()
    buffer.skip_partial_first_block("r", 6)
    buffer.reset()
    with pytest.raises(AssertionError, match="not contiguous"):
        buffer.capture("r", 6, rows(6, 7))


# --- the worker: begin_step -> prepare_output -> process_output ---------------------


def _worker() -> AuxOutputWorkerConnector:
    return bare_worker(new_buffer())


def _run_step(
    worker: AuxOutputWorkerConnector,
    emit_start: int,
    token_start: int,
    step_rows: np.ndarray,
    hashes: list[bytes],
) -> dict[str, AuxRequestOutput]:
    packed = {"r": PackedBlockHashes(b"".join(hashes), 32)} if hashes else {}
    metadata = AuxOutputConnectorMetadata(0, {"r": emit_start}, packed, ())
    return run_step(worker, metadata, "r", token_start, step_rows)


def test_decode_round_trip_emits_from_the_first_forward_and_publishes_block_8() -> None:
    worker = _worker()
    hashes = [bytes([i]) * 32 for i in range(3)]  # blocks 0, 4, 8
    out = _run_step(
        worker, emit_start=6, token_start=6, step_rows=rows(6, 7), hashes=hashes
    )
    assert out["r"].token_start == 6
    np.testing.assert_array_equal(out["r"].rows, rows(6, 7))
    for position in range(7, 12):
        out = _run_step(worker, position, position, rows(position, position + 1), [])
        assert out["r"].token_start == position
        # A Python int although the model runner's num_computed_tokens_np is
        # numpy: the scheduler forwards it into msgspec-encoded outputs as is.
        assert type(out["r"].token_start) is int
        np.testing.assert_array_equal(out["r"].rows, rows(position, position + 1))
    keys = worker._requests["r"].aux_output_keys
    np.testing.assert_array_equal(
        np.frombuffer(worker._store.get_concatenated([keys[2]]), np.uint8).reshape(
            BS, *SHAPE
        ),
        rows(8, 12),
    )
    with pytest.raises(Exception, match="does not exist"):
        worker._store.get_concatenated([keys[1]])  # the partially computed block 4
