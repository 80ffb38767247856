"""Compare a P/D response (through the proxy) with the colocated reference response."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from vllm.entrypoints.routed_experts import RoutedExpertsError

from tools.testbed.cpu_server import choice_rows
from tools.testbed.router_oracle import check_rows, oracle_rows


@dataclass
class Outcome:
    """One request's verdict; `problem` is None when P/D equals colocated."""

    tokens_equal: bool = False
    rows_equal: bool = False
    max_logprob_delta: float = 0.0
    # Positions whose rows differ from the transformers oracle only by a near-tie
    # (compare_with_oracle), and the largest such gap.
    near_ties: int = 0
    largest_near_tie_gap: float | None = None
    problem: str | None = None
    pd_choice: dict[str, Any] = field(default_factory=dict)


def post(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return {"error": f"HTTP {exc.code}: {exc.read().decode()[:600]}"}
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def hang_up(url: str, body: dict[str, Any], how: str = "stream",
            after_s: float = 0.4) -> None:
    """A client that gives up: sends `body` to /v1/completions and closes the
    connection after the first streamed chunk (how="stream") or after `after_s`
    without an answer (how="timeout"). The server aborts the request."""
    if how == "stream":
        body = body | {"stream": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    timeout = after_s if how == "timeout" else 600.0
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.readline()  # the first chunk (or line) of the answer, then close
    except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout):
        pass


def _decoded_rows(response: dict[str, Any], label: str,
                  problems: list[str]) -> np.ndarray | None:
    """The first choice's rows (None without any), counted against the response's
    prompt ids for chat too. Rows the fork's client decoder refuses
    count as none and add a problem naming `label`."""
    try:
        return choice_rows(response["choices"][0], response=response)
    except RoutedExpertsError as exc:
        problems.append(f"{label} rows refused by the client decoder: {exc}")
        return None


def _token_problems(out: Outcome, a: dict[str, Any], b: dict[str, Any],
                    label: str) -> list[str]:
    """Set `out`'s token verdict and logprob delta; the problems they show."""
    out.tokens_equal = a.get("token_ids") == b.get("token_ids")
    lp_a = (a.get("logprobs") or {}).get("token_logprobs") or []
    lp_b = (b.get("logprobs") or {}).get("token_logprobs") or []
    deltas = [abs(x - y) for x, y in zip(lp_a, lp_b) if x is not None and y is not None]
    out.max_logprob_delta = max(deltas, default=0.0)
    if out.tokens_equal:
        return []
    return [f"token ids differ: {label} {a.get('token_ids')} vs {b.get('token_ids')}"]


def _dtype_problems(rows: np.ndarray | None, expect_dtype: str | None) -> list[str]:
    if expect_dtype is None or rows is None or str(rows.dtype) == expect_dtype:
        return []
    return [f"rows have dtype {rows.dtype}, expected {expect_dtype}"]


def compare(pd: dict[str, Any], ref: dict[str, Any], expect_dtype: str | None = None,
            label: str = "P/D") -> Outcome:
    """`pd`: the response under test (`label` names it in messages); `ref`: colocated."""
    if "error" in ref:
        return Outcome(problem=f"reference failed: {ref['error']}")
    if "error" in pd:
        return Outcome(problem=f"{label} failed: {pd['error']}")
    a, b = pd["choices"][0], ref["choices"][0]
    out = Outcome(pd_choice=a)
    problems: list[str] = []
    rows_a = _decoded_rows(pd, label, problems)
    rows_b = _decoded_rows(ref, "colocated", problems)
    same_start = a.get("routed_experts_start") == b.get("routed_experts_start")
    if problems:  # rows the decoder refused equal nothing
        out.rows_equal = False
    elif rows_a is None or rows_b is None:
        out.rows_equal = rows_a is None and rows_b is None and same_start
    else:
        out.rows_equal = (same_start and rows_a.shape == rows_b.shape
                          and bool((rows_a.astype(np.int64) == rows_b.astype(np.int64)).all()))
    problems += _token_problems(out, a, b, label)
    if not out.rows_equal:
        problems.append(
            f"rows differ: {label} start {a.get('routed_experts_start')} shape "
            f"{None if rows_a is None else rows_a.shape}, colocated start "
            f"{b.get('routed_experts_start')} shape {None if rows_b is None else rows_b.shape}"
            + differing_positions(rows_a, rows_b, b.get("routed_experts_start")))
    problems += _dtype_problems(rows_a, expect_dtype)
    out.problem = "; ".join(problems) or None
    return out


def compare_group(pd: dict[str, Any], ref: dict[str, Any], n: int,
                  label: str = "P/D") -> Outcome:
    """A response with `n` choices (a request with `n > 1`) against the reference's
    answer to the same request, choice by choice by `index` (vLLM seeds child i with
    `seed + i`, so colocated serving draws the same choice i), not by order: each pair
    as `compare` checks one choice (tokens; rows and their start, by position). Both
    must hold exactly the indices 0..n-1, once each."""
    if "error" in ref:
        return Outcome(problem=f"reference failed: {ref['error']}")
    if "error" in pd:
        return Outcome(problem=f"{label} failed: {pd['error']}")
    problems: list[str] = []
    by_index: dict[str, dict[int, dict[str, Any]]] = {}
    for side, response in ((label, pd), ("colocated", ref)):
        indices = [choice.get("index") for choice in response.get("choices") or []]
        if len(indices) != n or set(indices) != set(range(n)):
            problems.append(f"{side} choices have indices {indices}, expected 0..{n - 1} "
                            "once each")
        by_index[side] = {choice.get("index"): choice
                          for choice in response.get("choices") or []}
    out = Outcome(tokens_equal=not problems, rows_equal=not problems)
    for index in range(n):
        a, b = by_index[label].get(index), by_index["colocated"].get(index)
        if a is None or b is None:
            out.tokens_equal = out.rows_equal = False
            continue
        one = compare(pd | {"choices": [a]}, ref | {"choices": [b]}, label=label)
        out.tokens_equal &= one.tokens_equal
        out.rows_equal &= one.rows_equal
        out.max_logprob_delta = max(out.max_logprob_delta, one.max_logprob_delta)
        if one.problem:
            problems.append(f"choice {index}: {one.problem}")
    out.problem = "; ".join(problems) or None
    return out


def compare_with_oracle(pd: dict[str, Any], ref: dict[str, Any], model_dir: Path,
                        margin: float, expect_dtype: str | None = None,
                        label: str = "P/D") -> Outcome:
    """`pd`'s rows against the transformers router top-k on its own tokens
    (tools/testbed/router_oracle.py), near-ties below `margin` allowed and counted:
    the check for shapes whose numerics differ from the reference's (bf16 with
    another TP size). Tokens are compared with the reference and counted, not
    required equal."""
    if "error" in ref:
        return Outcome(problem=f"reference failed: {ref['error']}")
    if "error" in pd:
        return Outcome(problem=f"{label} failed: {pd['error']}")
    choice = pd["choices"][0]
    out = Outcome(pd_choice=choice)
    problems: list[str] = []
    rows = _decoded_rows(pd, label, problems)
    if rows is None and not problems:
        problems.append(f"{label} returned no rows")
    if rows is not None:
        problems += _oracle_problems(out, choice, rows, model_dir, margin, label)
    out.rows_equal = not problems
    # Another TP size in bf16 may sample other tokens than the reference (near-tie
    # logits); the rows were checked on this response's own tokens, so a token
    # difference is counted (the table's "same tokens"), not a problem.
    _token_problems(out, choice, ref["choices"][0], label)
    problems += _dtype_problems(rows, expect_dtype)
    out.problem = "; ".join(problems) or None
    return out


def _oracle_problems(out: Outcome, choice: dict[str, Any], rows: np.ndarray,
                     model_dir: Path, margin: float, label: str) -> list[str]:
    """Check `rows` against the oracle on the tokens the choice forwarded (its prompt
    and every completion token but the last); count near-ties on `out`."""
    forwarded = list(choice.get("prompt_token_ids") or []) + list(choice["token_ids"][:-1])
    start = int(choice.get("routed_experts_start") or 0)
    try:
        verdict = check_rows(rows, start, oracle_rows(model_dir, forwarded, rows.shape[2]),
                             margin)
    except ValueError as exc:
        return [f"{label} rows do not fit the oracle: {exc}"]
    out.near_ties = len(verdict.near_ties)
    out.largest_near_tie_gap = verdict.largest_near_tie_gap
    if not verdict.mismatches:
        return []
    gaps = ", ".join(f"{g:.4g}" for g in verdict.mismatch_gaps[:8])
    return [f"rows differ from transformers' router top-k at {len(verdict.mismatches)} "
            f"of {len(rows)} positions where the top-k gap is >= {margin}: "
            f"{list(verdict.mismatches[:8])} (gaps {gaps})"]


def differing_positions(rows_a: np.ndarray | None, rows_b: np.ndarray | None,
                        start: int | None) -> str:
    """Where two row arrays of one shape and start differ, as absolute positions
    (the first few, and how many); "" when they cannot be compared position by position."""
    if rows_a is None or rows_b is None or rows_a.shape != rows_b.shape or start is None:
        return ""
    equal = (rows_a.astype(np.int64) == rows_b.astype(np.int64)).reshape(len(rows_a), -1)
    positions = [start + int(i) for i in np.flatnonzero(~equal.all(axis=1))]
    if not positions:
        return ""
    return (f"; {len(positions)} of {len(rows_a)} positions differ, at "
            f"{positions[:8]}{' ...' if len(positions) > 8 else ''}")

