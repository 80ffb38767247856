#!/usr/bin/env python3
"""Proxy merge throughput on a long-context payload (default 32k tokens x 78 layers x top-8).

    python -m benchmarks.proxy_merge [--tokens 32768] [--layers 78] [--topk 8] [--repeat 15]

Times `merge_choice` end to end as the proxy runs it: base64 + .npy decode of
both sides, the overlap check, the concatenation and the re-encode. Reports
GB/s of routed-experts payload (merged array bytes), best of N, side by side
for glibc's default allocator and for the proxy's allocator settings
(vllm_r3_pdproxy.memory), each measured in a fresh process in the same run
(benchmarks/measure.py).
It imports the installed proxy (pip install ./pdproxy; the test venv has it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.measure import Result, add_json_option, run_rounds, spread, timed
from vllm_r3_pdproxy.memory import reuse_freed_memory
from vllm_r3_pdproxy.merge import encode_npy, merge_choice

ROOT = Path(__file__).resolve().parents[1]


def measure(args: argparse.Namespace) -> float:
    """Best merge time in seconds for one payload."""
    rng = np.random.default_rng(0)
    prompt = args.tokens - args.completion
    rows = rng.integers(0, 256, size=(args.tokens - 1, args.layers, args.topk), dtype=np.uint8)
    prefill = {"routed_experts": encode_npy(rows[:prompt]), "routed_experts_start": 0}
    decode_payload = encode_npy(rows[prompt - 1:])
    times = []
    for _ in range(args.repeat):
        decode = {"index": 0, "routed_experts": decode_payload,
                  "routed_experts_start": prompt - 1}
        times.append(timed(lambda d=decode: merge_choice(prefill, d, 0, prompt,
                                                         args.completion))[0])
        del decode
    return spread(times).low


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=78)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--completion", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--allocator", choices=("default", "proxy"), help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    if args.allocator is not None:  # child: one allocator setting, one fresh process
        applied = args.allocator == "proxy" and reuse_freed_memory()
        print(json.dumps({"seconds": measure(args), "applied": applied}))
        return 0

    nbytes = (args.tokens - 1) * args.layers * args.topk
    print(f"payload ({args.tokens - 1}, {args.layers}, {args.topk}) uint8 = {nbytes / 1e6:.1f} MB, "
          f"{args.completion} completion tokens; best of {args.repeat} merges")
    print(f"{'allocator':34} {'ms/merge':>9} {'GB/s':>6}")

    def child(allocator: str, _: int) -> float:
        """One allocator's best merge, in a fresh process of its own."""
        out = subprocess.run([sys.executable, "-m", "benchmarks.proxy_merge",
                              "--allocator", allocator, *sys.argv[1:]], cwd=ROOT,
                             check=True, capture_output=True, text=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        label = ("glibc default" if allocator == "default" else
                 "proxy (freed memory kept)" if result["applied"] else "proxy (not glibc: default)")
        print(f"{label:34} {result['seconds'] * 1e3:9.1f} {nbytes / result['seconds'] / 1e9:6.2f}")
        return result["seconds"]

    results = {name: seconds for name, (seconds,) in
               run_rounds(("default", "proxy"), 1, child).items()}
    print(f"proxy / default throughput: {results['default'] / results['proxy']:.2f}x")
    Result("benchmarks.proxy_merge", vars(args), {"seconds": results},
           {"proxy / default throughput": results["default"] / results["proxy"]}
           ).emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
