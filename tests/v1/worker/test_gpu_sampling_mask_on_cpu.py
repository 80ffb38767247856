"""The sampling mask of Model Runner V2 (`--return-sampling-mask`) on the CPU
platform, where Triton's interpreter runs `_compact_sampling_mask_kernel`.

On vLLM 0.31.0 the kernel and-ed a broadcast scalar condition into its store
mask; the interpreter typed that broadcast as int32, refused the store ("mask
has unsupported dtype") and the engine core died on the first sampled request.

The expected supports are written out by hand from the rule the kernel
implements: a row's support is the ids of its finite logits (not -inf, +inf or
NaN) in ascending order, and a row without a sampled token (a chunked prefill)
has an empty support. Each case runs in a child process with the environment a
CPU engine's worker inherits under VLLM_CPU_TRITON_INTERPRET=1 (TRITON_INTERPRET=1
set before Triton is imported), since Triton reads it when a kernel is defined.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Read from stdin: {"vocab_size", "width", "rows": [{"finite": [...], "sampled":
# n, "nan": [...], "posinf": [...]}]}; print each row's support as the scheduler
# receives it (SamplingMaskTensors.tolists).
CHILD = r"""
import inspect, json, sys
import torch
from vllm.v1.worker.gpu.sample.output import SamplingMaskTensors

case = json.load(sys.stdin)
rows = case["rows"]
logits = torch.full((len(rows), case["vocab_size"]), -float("inf"))
for i, row in enumerate(rows):
    logits[i, row["finite"]] = torch.linspace(-2.0, 2.0, len(row["finite"]))
    logits[i, row.get("nan", [])] = float("nan")
    logits[i, row.get("posinf", [])] = float("inf")
num_sampled = torch.tensor([row["sampled"] for row in rows], dtype=torch.int32)
params = inspect.signature(SamplingMaskTensors.from_logits).parameters
if "cu_num_logits" in params:  # vLLM 0.34.0: one logits row per request here
    cu_num_logits = torch.arange(len(rows) + 1, dtype=torch.int32)
    mask = SamplingMaskTensors.from_logits(
        logits, cu_num_logits, num_sampled, case["width"])
else:
    mask = SamplingMaskTensors.from_logits(logits, num_sampled, case["width"])
lists = mask.tolists()
offsets = lists.offsets.tolist()
print(json.dumps([lists.token_ids[offsets[i]:offsets[i + 1]].tolist()
                  for i in range(len(rows))]))
"""


def supports(case: dict) -> list[list[int]]:
    env = {**os.environ, "VLLM_CPU_TRITON_INTERPRET": "1", "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(case),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.cpu_test
def test_supports_of_one_block_with_a_chunked_prefill_row() -> None:
    case = {
        "vocab_size": 20,
        "width": 4,
        "rows": [
            {"finite": [3, 7, 11], "sampled": 1},
            # NaN and +inf are not finite; 15 finite ids are wider than the
            # compact row (4), so this support comes from the bitmask.
            {
                "finite": [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
                "nan": [5],
                "posinf": [6],
                "sampled": 1,
            },
            {"finite": list(range(20)), "sampled": 0},
            {"finite": [19], "sampled": 2},
        ],
    }
    assert supports(case) == [
        [3, 7, 11],
        [3, 4, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
        [],
        [19],
    ]


@pytest.mark.cpu_test
def test_supports_across_two_kernel_blocks() -> None:
    """A vocabulary wider than the kernel's 8192-logit block."""
    case = {
        "vocab_size": 9000,
        "width": 3,
        "rows": [
            {"finite": [0, 8191, 8192, 8999], "sampled": 1},
            {"finite": list(range(9000)), "sampled": 0},
            {"finite": [8500], "sampled": 1},
        ],
    }
    assert supports(case) == [[0, 8191, 8192, 8999], [], [8500]]
