#!/usr/bin/env python3
"""Proxy merge throughput on a long-context payload (default 32k tokens x 78 layers x top-8).

    python benchmarks/proxy_merge.py [--tokens 32768] [--layers 78] [--topk 8] [--repeat 5]

Times `merge_choice` end to end as the proxy runs it: base64 + .npy decode of
both sides, the overlap check, the concatenation, and the re-encode. Reports
GB/s of routed-experts payload (merged array bytes) per second, best of N.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "pdproxy"))

from merge import encode_npy, merge_choice  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=78)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--completion", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    total = args.tokens
    prompt = total - args.completion
    rows = rng.integers(0, 256, size=(total - 1, args.layers, args.topk), dtype=np.uint8)
    prefill = {"routed_experts": encode_npy(rows[:prompt]), "routed_experts_start": 0}
    decode_payload = encode_npy(rows[prompt - 1:])
    best = float("inf")
    for _ in range(args.repeat):
        decode = {"index": 0, "routed_experts": decode_payload,
                  "routed_experts_start": prompt - 1}
        start = time.perf_counter()
        merge_choice(prefill, decode, 0, prompt, args.completion)
        best = min(best, time.perf_counter() - start)
    nbytes = rows.nbytes
    print(f"payload {rows.shape} uint8 = {nbytes / 1e6:.1f} MB; best merge {best * 1e3:.1f} ms; "
          f"{nbytes / best / 1e9:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
