# SPDX-License-Identifier: Apache-2.0
"""The fixed request set the CPU-per-request benchmarks send: a library of
cpu_per_request and gpu/r3_cost, not a script (their spread over the rounds is
benchmarks/measure.py's)."""

from __future__ import annotations


def prompts(num_requests: int, num_tokens: int) -> list[list[int]]:
    """A fixed request set: distinct prompts (no prefix cache hits between them)
    of word tokens 4..511."""
    return [
        [4 + (request * 131 + position * 7 + position // 11) % 508
         for position in range(num_tokens)]
        for request in range(num_requests)
    ]
