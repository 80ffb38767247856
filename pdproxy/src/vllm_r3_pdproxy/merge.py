"""Merge prefill and decode routed-experts rows by position.

Contract:
- Each side's response choice carries `routed_experts` (base64 `.npy` of shape
  (rows, layers, top_k), uint8 or uint16) and `routed_experts_start`, the
  absolute position of its first row (the fork's explicit start).
- Prefill rows cover [start_p, end_p); decode rows cover [start_d, end_d),
  normally start_d = P - 1, one row of overlap. The merge takes prefill rows
  for [start_p, end_p) and decode rows from end_p on.
- Overlap policy, for positions both sides computed (normally P - 1 only):
  "error" (default) fails when they differ; "prefill" keeps prefill's row,
  which is what colocated serving returns; "decode" keeps decode's row, which
  is the routing that produced the first completion token on the decode
  instance. Without batch-invariant kernels the decode instance's recompute
  of P - 1 can flip a near-tie expert (docs/pd-proxy.md).
- The merged rows must start at the request's `routed_experts_prompt_start`
  and end at P + C - 1 (the last sampled token has no row).
- Both sides hold rows of one dtype: uint8 rows come from a model with at
  most 256 experts, uint16 rows from one with more, so a uint8 side and a
  uint16 side served different models and never merge.

Failure policy: any inconsistency raises `MergeError` with the numbers in the
message; a merged array is never returned when one of the checks fails.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64  # vLLM's own base64 (SIMD); the servers encode rows with it
from numpy.lib import format as npy_format

ROW_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))
OVERLAP_POLICIES = ("error", "prefill", "decode")


class MergeError(ValueError):
    """The two halves of a P/D response cannot be merged into trustworthy rows."""


@dataclass
class MergeReport:
    """What a merge did beyond concatenating: overlap rows that differed, and the first."""

    overlap_rows_differing: int = 0
    first_differing_position: int | None = None


@dataclass(frozen=True)
class RoutedRows:
    start: int
    rows: np.ndarray  # (n, layers, top_k)
    # The complete `.npy` file whose data section *is* `rows`, when the rows were
    # built in place (merge_rows does), so encoding them needs no further copy.
    npy: bytearray | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.rows)


def decode_npy(payload: str, side: str) -> np.ndarray:
    """A base64 `.npy` payload as a read-only array over the decoded bytes (no copy)."""
    try:
        raw = pybase64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as exc:
        raise MergeError(f"{side} routed_experts is not valid base64: {exc}") from None
    head = io.BytesIO(raw[:4096])
    try:
        version = npy_format.read_magic(head)
        read_header = {(1, 0): npy_format.read_array_header_1_0,
                       (2, 0): npy_format.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f".npy format version {version} is not 1.0 or 2.0")
        shape, fortran_order, dtype = read_header(head)
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise MergeError(
            f"{side} routed_experts is not a .npy array ({len(raw)} bytes): {exc}"
        ) from None
    if fortran_order or dtype.hasobject:
        raise MergeError(f"{side} routed_experts must be a C-ordered plain array, got "
                         f"fortran_order={fortran_order}, dtype={dtype}")
    offset = head.tell()
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - offset != expected:
        raise MergeError(
            f"{side} routed_experts .npy holds {len(raw) - offset} data bytes, but its header "
            f"says shape {shape} of {dtype} = {expected} bytes"
        )
    return np.frombuffer(raw, dtype=dtype, count=expected // dtype.itemsize,
                         offset=offset).reshape(shape)


def npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The `.npy` header `np.save` writes for a C-ordered array of this shape and dtype."""
    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, {"descr": npy_format.dtype_to_descr(dtype),
                                               "fortran_order": False, "shape": shape})
    return header.getvalue()


def empty_npy(shape: tuple[int, ...], dtype: np.dtype) -> tuple[bytearray, np.ndarray]:
    """A `.npy` file in memory and a writable array over its data section."""
    header = npy_header(shape, dtype)
    npy = bytearray(len(header) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    npy[: len(header)] = header
    return npy, np.frombuffer(npy, dtype=dtype, offset=len(header)).reshape(shape)


def encode_npy(array: np.ndarray) -> str:
    """Base64 `.npy`, byte for byte what vLLM's serving layer sends."""
    npy, view = empty_npy(array.shape, array.dtype)
    view[...] = array
    return pybase64.b64encode_as_string(npy)


def encode_rows(rows: RoutedRows) -> str:
    if rows.npy is not None:
        return pybase64.b64encode_as_string(rows.npy)
    return encode_npy(rows.rows)


def rows_from_choice(choice: dict[str, Any], side: str) -> RoutedRows | None:
    """The routed rows of one response choice, or None when it carries none."""
    payload = choice.get("routed_experts")
    if payload is None:
        return None
    if not isinstance(payload, str):
        raise MergeError(
            f"{side} routed_experts must be a base64 .npy string, got {type(payload).__name__}"
        )
    start = choice.get("routed_experts_start")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise MergeError(
            f"{side} routed_experts_start must be a non-negative integer, got {start!r}; "
            f"is the {side} server running the R3 fork?"
        )
    rows = decode_npy(payload, side)
    if rows.ndim != 3:
        raise MergeError(
            f"{side} routed_experts must have shape (seq, layers, topk), got {rows.shape}"
        )
    if rows.dtype not in ROW_DTYPES:
        raise MergeError(f"{side} routed_experts has dtype {rows.dtype}; expected uint8 or uint16")
    return RoutedRows(start, rows)


def common_dtype(prefill: np.dtype, decode: np.dtype) -> np.dtype:
    """The merged rows' dtype: both sides' own (uint8: at most 256 experts)."""
    if prefill == decode:
        return prefill
    raise MergeError(
        f"cannot concatenate routed_experts with dtypes {prefill} (prefill) and "
        f"{decode} (decode): uint8 rows come from a model with at most 256 experts, "
        "uint16 rows from one with more; are prefill and decode serving the same model?"
    )


def merge_rows(prefill: RoutedRows, decode: RoutedRows, overlap: str = "error",
               report: MergeReport | None = None) -> RoutedRows:
    """Prefill rows for [start_p, end_p), decode rows from end_p on; see the overlap policy."""
    if overlap not in OVERLAP_POLICIES:
        raise ValueError(f"overlap policy {overlap!r} is not one of {OVERLAP_POLICIES}")
    if prefill.rows.shape[1:] != decode.rows.shape[1:]:
        raise MergeError(
            "cannot concatenate routed_experts with shapes "
            f"{prefill.rows.shape} and {decode.rows.shape}"
        )
    dtype = common_dtype(prefill.rows.dtype, decode.rows.dtype)
    if decode.start > prefill.end:
        raise MergeError(
            f"gap in routed_experts: prefill rows cover [{prefill.start}, {prefill.end}), "
            f"decode rows start at {decode.start}"
        )
    if decode.start < prefill.start:
        raise MergeError(
            f"decode routed_experts start at {decode.start}, before the prefill rows "
            f"[{prefill.start}, {prefill.end}); the two sides disagree on the prompt start"
        )
    overlap_end = min(prefill.end, decode.end)
    head = prefill.rows
    if decode.start < overlap_end:
        mine = prefill.rows[decode.start - prefill.start: overlap_end - prefill.start]
        theirs = decode.rows[: overlap_end - decode.start]
        differs = np.flatnonzero((mine.astype(np.int64) != theirs.astype(np.int64))
                                 .reshape(len(mine), -1).any(axis=1))
        if len(differs):
            position = decode.start + int(differs[0])
            if report is not None:
                report.overlap_rows_differing += len(differs)
                report.first_differing_position = position
            if overlap == "error":
                raise MergeError(
                    f"prefill and decode routed_experts disagree at position {position} "
                    f"(overlap [{decode.start}, {overlap_end}), {len(differs)} differing rows): "
                    f"prefill {prefill.rows[position - prefill.start].tolist()}, "
                    f"decode {decode.rows[position - decode.start].tolist()}"
                )
            if overlap == "decode":
                head = head[: decode.start - prefill.start]
    tail = decode.rows[max(len(head) + prefill.start - decode.start, 0):]
    npy, merged = empty_npy((len(head) + len(tail), *head.shape[1:]), dtype)
    merged[: len(head)] = head
    merged[len(head):] = tail
    return RoutedRows(prefill.start, merged, npy)


def check_coverage(merged: RoutedRows, prompt_start: int, num_prompt: int,
                   num_completion: int) -> None:
    """The merged rows must cover exactly [s, P + C - 1)."""
    end = num_prompt + num_completion - 1
    if merged.start != prompt_start or merged.end != end:
        raise MergeError(
            f"merged routed_experts cover [{merged.start}, {merged.end}), expected "
            f"[routed_experts_prompt_start, P + C - 1) = [{prompt_start}, {end}) "
            f"with P = {num_prompt}, C = {num_completion}"
        )


def merge_choice(prefill_choice: dict[str, Any], decode_choice: dict[str, Any],
                 prompt_start: int, num_prompt: int, num_completion: int,
                 overlap: str = "error", report: MergeReport | None = None) -> None:
    """Replace the decode choice's rows with the merged rows, in place."""
    decode = rows_from_choice(decode_choice, "decode")
    prefill = rows_from_choice(prefill_choice, "prefill")
    if decode is None:
        if prefill is not None:
            raise MergeError("prefill response contained routed_experts, but decode choice "
                             f"{decode_choice.get('index', 0)} did not")
        return
    if prefill is None and decode.start == prompt_start:
        # Complete already: the rows traveled with the KV (decode runs with
        # enable_routed_experts_transfer), or s >= P - 1. Pass it through unchanged.
        check_coverage(decode, prompt_start, num_prompt, num_completion)
        return
    if prefill is None:
        # The prefill side has no rows when s = P: an empty segment at s.
        prefill = RoutedRows(prompt_start, decode.rows[:0])
    merged = merge_rows(prefill, decode, overlap, report)
    check_coverage(merged, prompt_start, num_prompt, num_completion)
    decode_choice["routed_experts"] = encode_rows(merged)
    decode_choice["routed_experts_start"] = merged.start
