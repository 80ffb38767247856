# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Client-side decoding of the routed-experts rows a vLLM server returns.

With ``--enable-return-routed-experts``, every choice of a completion, chat
completion or token-in/token-out response carries:

- ``routed_experts``: a base64 ``.npy`` array of shape (rows, layers, top_k),
  uint8 or uint16: row ``i`` is the router's top-k expert ids, per MoE layer,
  for the token at absolute position ``routed_experts_start + i``;
- ``routed_experts_start``: that first position (``routed_experts_prompt_start``
  of the request).

The last sampled token has no row (it was never forwarded), so a choice with P
prompt and C completion tokens has rows for positions [start, P + C - 1).

Contract: ``decode_routed_experts`` returns the rows with their absolute start,
or raises ``RoutedExpertsError`` naming the field, what was found and what was
expected; it never returns rows it could not validate. ``merge_by_position``
joins the rows of several responses (e.g. the turns of one conversation, each
sent with the earlier turns as its prompt prefix) into one array indexed by
position, and fails when two of them disagree on a position or leave a gap.
"""

from __future__ import annotations

import binascii
import io
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64
from numpy.lib import format as npy_format

ROW_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))
# The .npy format versions a server writes (numpy writes 1.0, or 2.0 for a
# header longer than 64 KiB); a reader of another version may read it wrongly.
_NPY_HEADER_READERS = {
    (1, 0): npy_format.read_array_header_1_0,
    (2, 0): npy_format.read_array_header_2_0,
}
# A .npy header is at most this long in any array a server writes.
_NPY_HEADER_MAX = 4096


class RoutedExpertsError(ValueError):
    """A response's routed-experts rows are missing, malformed or inconsistent."""


@dataclass(frozen=True)
class RoutedExperts:
    """Rows for the absolute positions [start, start + len(rows))."""

    start: int
    rows: np.ndarray  # (num_rows, num_layers, top_k), uint8 or uint16

    @property
    def end(self) -> int:
        return self.start + len(self.rows)

    def at(self, position: int) -> np.ndarray:
        """The (layers, top_k) expert ids of the token at ``position``."""
        if not self.start <= position < self.end:
            raise RoutedExpertsError(
                f"position {position} is outside the rows [{self.start}, {self.end})"
            )
        return self.rows[position - self.start]


def _decode_npy(payload: Any, field: str) -> np.ndarray:
    """A base64 ``.npy`` payload as an array, read strictly: version 1.0 or
    2.0, a C-ordered plain dtype, and exactly the data bytes its header
    describes (checked before anything is allocated)."""
    if not isinstance(payload, str):
        raise RoutedExpertsError(
            f"{field} must be a base64 string of a .npy array, got "
            f"{type(payload).__name__}; start the server with "
            "--enable-return-routed-experts"
        )
    try:
        data = pybase64.b64decode(payload, validate=True)
        head = io.BytesIO(data[:_NPY_HEADER_MAX])
        version = npy_format.read_magic(head)
        read_header = _NPY_HEADER_READERS.get(version)
        if read_header is None:
            raise ValueError(f".npy format version {version}, not 1.0 or 2.0")
        shape, fortran_order, dtype = read_header(head)
    except (binascii.Error, ValueError, EOFError, OSError, SyntaxError) as e:
        raise RoutedExpertsError(
            f"{field} is not a base64 .npy array ({len(payload)} characters): {e}"
        ) from None
    if fortran_order or dtype.hasobject:
        raise RoutedExpertsError(
            f"{field} must be a C-ordered array of plain values, got "
            f"fortran_order={fortran_order}, dtype={dtype}"
        )
    offset = head.tell()
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - offset != expected:
        raise RoutedExpertsError(
            f"{field} holds {len(data) - offset} data bytes, but its .npy header "
            f"says shape {shape} of {dtype}: {expected} bytes"
        )
    count = expected // dtype.itemsize if dtype.itemsize else 0
    rows = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return rows.reshape(shape).copy()


def decode_routed_experts(
    choice: Mapping[str, Any],
    *,
    num_layers: int | None = None,
    top_k: int | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> RoutedExperts:
    """Decode one response choice's rows and their absolute start.

    ``num_layers`` and ``top_k``, when given, are checked against the array.
    When the choice carries ``prompt_token_ids`` and ``token_ids`` (requests
    with ``return_token_ids``), the number of rows is checked against them. A
    chat completion carries ``prompt_token_ids`` on the response, not on the
    choice: pass it as ``prompt_token_ids`` to have its rows counted too.
    """
    if "routed_experts" not in choice or choice["routed_experts"] is None:
        raise RoutedExpertsError(
            "choice has no routed_experts; start the server with "
            "--enable-return-routed-experts"
        )
    rows = _decode_npy(choice["routed_experts"], "routed_experts")
    start = choice.get("routed_experts_start")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise RoutedExpertsError(
            f"routed_experts_start must be a non-negative integer, got {start!r}; "
            "a server or router that drops it returns rows whose positions are "
            "unknown"
        )
    if rows.ndim != 3:
        raise RoutedExpertsError(
            f"routed_experts must have shape (rows, layers, top_k), got {rows.shape}"
        )
    if rows.dtype not in ROW_DTYPES:
        raise RoutedExpertsError(
            f"routed_experts must be uint8 or uint16 expert ids, got {rows.dtype}"
        )
    for name, want, got in (
        ("layers", num_layers, rows.shape[1]),
        ("top_k", top_k, rows.shape[2]),
    ):
        if want is not None and got != want:
            raise RoutedExpertsError(
                f"routed_experts has {got} {name}, expected {want}: rows of "
                "another model?"
            )
    prompt = choice.get("prompt_token_ids")
    if prompt is None and prompt_token_ids is not None:
        prompt = list(prompt_token_ids)
    completion = choice.get("token_ids")
    if isinstance(prompt, list) and isinstance(completion, list):
        want_rows = len(prompt) + len(completion) - 1 - start
        if len(rows) != max(want_rows, 0):
            raise RoutedExpertsError(
                f"routed_experts has {len(rows)} rows from position {start}, "
                f"expected {want_rows} ({len(prompt)} prompt + {len(completion)} "
                f"completion tokens - 1 - {start}): rows are missing"
            )
    return RoutedExperts(start, rows)


def merge_by_position(parts: Iterable[RoutedExperts]) -> RoutedExperts:
    """Join rows that cover adjacent or overlapping positions into one.

    Overlapping positions must hold equal rows (e.g. the prefix a later turn
    shares with an earlier one); parts must leave no gap and share one shape
    and one dtype per row: uint8 and uint16 rows come from models with
    different expert counts, so they never merge.
    """
    ordered = sorted(parts, key=lambda p: p.start)
    if not ordered:
        raise RoutedExpertsError("nothing to merge")
    shape = ordered[0].rows.shape[1:]
    dtype = ordered[0].rows.dtype
    start, end = ordered[0].start, max(p.end for p in ordered)
    merged = np.zeros((end - start, *shape), dtype)
    covered = ordered[0].start
    for part in ordered:
        if part.rows.shape[1:] != shape or part.rows.dtype != dtype:
            raise RoutedExpertsError(
                f"rows from position {part.start} are {part.rows.dtype} of shape "
                f"{part.rows.shape[1:]} per token, others {dtype} of {shape}: rows "
                "of another model?"
            )
        if part.start > covered:
            raise RoutedExpertsError(f"no rows for positions [{covered}, {part.start})")
        overlap_end = min(covered, part.end)
        if overlap_end > part.start:
            have = merged[part.start - start : overlap_end - start]
            new = part.rows[: overlap_end - part.start]
            differ = np.flatnonzero((have != new).reshape(len(have), -1).any(axis=1))
            if len(differ):
                raise RoutedExpertsError(
                    f"rows differ at position {part.start + int(differ[0])} "
                    f"({len(differ)} positions in [{part.start}, {overlap_end}))"
                )
        merged[part.start - start : part.end - start] = part.rows
        covered = max(covered, part.end)
    return RoutedExperts(start, merged)
