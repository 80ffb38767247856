"""A request whose routed-experts rows cannot be read fails alone (patch
`fail-one-request-when-its-routed-experts-rows-are`).

The worker reads a request's rows of earlier steps from its block store. When they
are not there (a KV load that did not hand its rows to the capture, an evicted
block), that request's output says why, and the other requests of the same step
get their rows as before. Before this patch the store's `BlockObjectStoreError`
left `process_output` and killed the engine.

Rows are distinguishable: row p holds p in every slot.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.dash_o import json_under_dash_o
from tests.distributed.aux_output_connector.aux_worker_utils import (
    bare_worker,
    run_step,
)
from vllm.distributed.aux_output_connector.connector import (
    AuxOutputConnectorMetadata,
    PackedBlockHashes,
)
from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer

SHAPE = (3, 2)  # (layers, top_k)
BS = 4


def rows(start: int, end: int) -> np.ndarray:
    return np.broadcast_to(
        np.arange(start, end, dtype=np.uint8)[:, None, None], (end - start, *SHAPE)
    ).copy()


def two_request_step(
    emit_starts: dict[str, int],
    token_starts: dict[str, int],
    num_tokens: dict[str, int],
    hashes: dict[str, int],
):
    """One step of two requests on a fresh worker: each computes `num_tokens` from
    its `token_start`, its first `hashes` blocks are keyed, and one token is
    sampled for each."""
    worker = bare_worker(RoutedExpertsBuffer(np.dtype(np.uint8), SHAPE, BS, 2, 16, 2))
    packed = {
        rid: PackedBlockHashes(
            b"".join(bytes([i + 16 * n]) * 32 for i in range(count)), 32
        )
        for n, (rid, count) in enumerate(hashes.items())
        if count
    }
    worker.begin_step(AuxOutputConnectorMetadata(0, dict(emit_starts), packed, ()))
    ids = list(emit_starts)
    step_rows = np.concatenate(
        [rows(token_starts[r], token_starts[r] + num_tokens[r]) for r in ids]
    )
    worker._capturer.snapshot_routing_data.return_value = torch.from_numpy(step_rows)
    bounds = np.cumsum([0] + [num_tokens[r] for r in ids]).astype(np.int32)
    batch = SimpleNamespace(
        req_ids=ids,
        query_start_loc_np=bounds,
        num_computed_tokens_np=np.array([token_starts[r] for r in ids], np.int32),
    )
    pending = worker.prepare_output(batch)
    assert pending is not None
    pending.enqueue_cpu_copy(np.ones(len(ids), np.int64), np.zeros(len(ids), np.int64))
    return worker, pending.process_output()


def test_rows_missing_from_the_store_fail_that_request_only() -> None:
    # "loaded": its KV of positions [0, 8) was loaded, but no rows were published
    # for blocks 0 and 4, and it asks for rows from 0. "computed": a request of
    # the same step that computes its whole prompt.
    worker, outputs = two_request_step(
        emit_starts={"loaded": 0, "computed": 0},
        token_starts={"loaded": 8, "computed": 0},
        num_tokens={"loaded": 3, "computed": 6},
        hashes={"loaded": 2, "computed": 1},
    )
    failed = outputs["loaded"]
    assert failed.error is not None
    assert "[0, 11)" in failed.error, failed.error
    assert len(failed.rows) == 0
    # The other request's rows are untouched by the failure.
    ok = outputs["computed"]
    assert ok.error is None
    assert ok.token_start == 0
    np.testing.assert_array_equal(ok.rows, rows(0, 6))
    # The failed request does not poison the next step of the other one.
    assert worker._requests["computed"].emit_cursor == 6


def test_rows_that_are_there_carry_no_error() -> None:
    """Negative control: the same layout with the loaded prefix's rows computed
    here (token_start 0) returns them, without an error."""
    _, outputs = two_request_step(
        emit_starts={"loaded": 0, "computed": 0},
        token_starts={"loaded": 0, "computed": 0},
        num_tokens={"loaded": 11, "computed": 6},
        hashes={"loaded": 2, "computed": 1},
    )
    assert outputs["loaded"].error is None
    np.testing.assert_array_equal(outputs["loaded"].rows, rows(0, 11))


@pytest.mark.parametrize("emit_start", [0, 4])
def test_the_error_names_the_positions_and_the_cause(emit_start: int) -> None:
    _, outputs = two_request_step(
        emit_starts={"loaded": emit_start},
        token_starts={"loaded": 8},
        num_tokens={"loaded": 1},
        hashes={"loaded": 2},
    )
    error = outputs["loaded"].error
    assert error is not None
    assert f"[{emit_start}, 9)" in error
    assert "routed-experts rows" in error
    assert "BlockObjectStoreError" in error  # the cause, as the server log says it


def test_rows_a_pull_brought_that_cannot_be_read_fail_that_request() -> None:
    """A P/D decode request whose import does not cover its positions (one slot
    for 8 positions of 4-token blocks) fails at its first output; before, the
    mirror's check left begin_step and killed the engine."""
    from vllm.distributed.aux_output_connector.rows_transfer import (
        RowsFormat,
        RowsImport,
        RowsMirror,
    )

    worker = bare_worker(RoutedExpertsBuffer(np.dtype(np.uint8), SHAPE, BS, 2, 16, 2))
    worker._rows_mirror = RowsMirror(RowsFormat(3, 2, "uint8", BS), num_blocks=4)
    metadata = AuxOutputConnectorMetadata(
        0, {"d": 0}, {}, (), rows_imports={"d": RowsImport(0, 8, (1,))}
    )
    worker.begin_step(metadata)
    worker._capturer.snapshot_routing_data.return_value = torch.from_numpy(rows(7, 8))
    batch = SimpleNamespace(
        req_ids=["d"],
        query_start_loc_np=np.array([0, 1], np.int32),
        num_computed_tokens_np=np.array([7], np.int32),
    )
    pending = worker.prepare_output(batch)
    pending.enqueue_cpu_copy(np.array([1]), np.array([0]))
    error = pending.process_output()["d"].error
    assert error is not None
    assert "import [0, 8) is not covered by its 1 blocks" in error


def capture_gap_step() -> dict[str, tuple[str | None, list[int]]]:
    """A step where "mid"'s first capture starts mid-block (position 9) while its
    rows are wanted from 0: rows [8, 9) were neither computed nor imported here.
    Returns each request's (error, first value of each row)."""
    _, outputs = two_request_step(
        emit_starts={"mid": 0, "computed": 0},
        token_starts={"mid": 9, "computed": 0},
        num_tokens={"mid": 1, "computed": 6},
        hashes={"mid": 0, "computed": 1},
    )
    return {
        rid: (out.error, out.rows[:, 0, 0].tolist()) for rid, out in outputs.items()
    }


CAPTURE_GAP_ERROR = (
    "routed-experts rows of positions [0, 10) could not be read (auxiliary "
    "output capture is not contiguous: request=mid, expected=8, actual=9)"
)


def test_a_capture_that_does_not_continue_fails_that_request_only() -> None:
    """E.g. a P/D decode request whose rows import is missing while its rows
    are wanted from 0. Before, the buffer's contiguity assert left
    process_output (the engine died); under ``python -O`` the rows were staged
    at the wrong offset."""
    outputs = capture_gap_step()
    assert outputs["mid"] == (CAPTURE_GAP_ERROR, [])
    assert outputs["computed"] == (None, [0, 1, 2, 3, 4, 5])


def test_a_capture_that_does_not_continue_fails_alike_under_dash_o() -> None:
    outputs = json_under_dash_o(__file__, "capture_gap_step")
    assert outputs["mid"] == [CAPTURE_GAP_ERROR, []]
    assert outputs["computed"] == [None, [0, 1, 2, 3, 4, 5]]


def test_an_import_that_ends_before_the_first_capture_fails_that_request() -> None:
    worker = bare_worker(RoutedExpertsBuffer(np.dtype(np.uint8), SHAPE, BS, 2, 16, 2))
    worker.begin_step(AuxOutputConnectorMetadata(0, {"d": 0}, {}, ()))
    # Rows [0, 4) were imported, but decode's first forward is at 7.
    worker._requests["d"].rows_import = (0, rows(0, 4))
    worker._capturer.snapshot_routing_data.return_value = torch.from_numpy(rows(7, 8))
    batch = SimpleNamespace(
        req_ids=["d"],
        query_start_loc_np=np.array([0, 1], np.int32),
        num_computed_tokens_np=np.array([7], np.int32),
    )
    pending = worker.prepare_output(batch)
    pending.enqueue_cpu_copy(np.array([1]), np.array([0]))
    output = pending.process_output()["d"]
    assert output.error == (
        "routed-experts rows of positions [0, 7) could not be read (ValueError: "
        "the routed-experts rows import ends before the first capture: "
        "import=[0, 4), capture_start=7)"
    )
    assert len(output.rows) == 0
    # Its later steps fail the same way instead of capturing after the hole.
    assert worker._requests["d"].rows_error is not None


def test_a_request_that_runs_on_is_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request that asked for no rows is not failed for them and runs on: each
    of its outputs still says its rows are missing, the log says it once."""
    worker = bare_worker(RoutedExpertsBuffer(np.dtype(np.uint8), SHAPE, BS, 2, 16, 2))
    errors = []
    for token in (9, 10, 11):  # the first capture does not continue: a gap
        metadata = AuxOutputConnectorMetadata(0, {"mid": 0}, {}, ())
        out = run_step(worker, metadata, "mid", token, rows(token, token + 1))
        errors.append(out["mid"].error)
    assert errors[0] == (
        "routed-experts rows of positions [0, 10) could not be read (auxiliary "
        "output capture is not contiguous: request=mid, expected=8, actual=9)"
    )
    assert all(error is not None for error in errors[1:])
    warnings = [r for r in caplog.records if "could not be read" in r.getMessage()]
    assert len(warnings) == 1


def test_rows_missing_from_the_store_are_reported_once_then_new_rows_flow() -> None:
    """After a failed read the request emits from its next rows, which it
    captured: the next step has rows and no error (the scheduler has failed
    the request, or it asked for no rows)."""
    worker, outputs = two_request_step(
        emit_starts={"loaded": 0},
        token_starts={"loaded": 8},
        num_tokens={"loaded": 3},
        hashes={"loaded": 2},
    )
    assert outputs["loaded"].error is not None

    metadata = AuxOutputConnectorMetadata(0, {}, {}, ())
    out = run_step(worker, metadata, "loaded", 11, rows(11, 12))["loaded"]
    assert out.error is None
    assert (out.token_start, out.rows[:, 0, 0].tolist()) == (11, [11])


def test_an_import_whose_slot_fails_its_check_fails_that_request() -> None:
    """The worker checks every slot of an import again before it reads a row
    (RowsMirror.read): a slot no load filled fails the request at its first
    output, and no row is returned."""
    from vllm.distributed.aux_output_connector.rows_transfer import (
        RowsFormat,
        RowsMirror,
        import_checked_rows,
    )

    worker = bare_worker(RoutedExpertsBuffer(np.dtype(np.uint8), SHAPE, BS, 2, 16, 2))
    worker._rows_mirror = RowsMirror(RowsFormat(3, 2, "uint8", BS), num_blocks=4)
    rows_import = import_checked_rows(list(range(4, 12)), BS, 0, 7, (1, 2))
    metadata = AuxOutputConnectorMetadata(
        0, {"d": 0}, {}, (), rows_imports={"d": rows_import}
    )
    output = run_step(worker, metadata, "d", 7, rows(7, 8))["d"]
    assert len(output.rows) == 0
    assert output.error == (
        "routed-experts rows of positions [0, 7) could not be read (routed-experts "
        "rows import [0, 7): the slot of block 1 failed its check: no rows (tag "
        "not written by this format))"
    )
