"""Streamed P/D responses carry every row in each choice's final chunk.

    python -m tools.e2e.pd_streaming [--router vllm-router|pdproxy] [--no-transfer]
                                     [--workdir DIR]

A P/D pair of the installed fork with rows that travel with the KV (the switch on
both roles, chains from `vllm kv-transfer-config --routed-experts-transfer`), behind
the real `vllm-router` binary (default) or `vllm-r3-pdproxy`, and a colocated
reference, on the harness's tiny MoE. For each prompt (rows from 0, and from
mid-prompt) the streamed response through the router must carry, on its final chunk
only, `routed_experts_start` = the request's `routed_experts_prompt_start` and rows
equal to the reference's non-streaming rows (patch
return-routed-experts-rows-in-the-final-stream-chunk); its tokens must equal the
reference's. Exit 0 only when every check holds; the last line is the summary.

--no-transfer is the negative control: the switch off on both roles, so decode holds
only the rows from its own first forward, a stream that merely forwards decode's
chunks is incomplete, and the run must exit 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from tests.v1.cpu_server import decode_routed_experts, final_chunk_rows, post_json, post_stream
from tests.v1.tiny_moe import build
from tools.e2e.checks import Check, report
from tools.e2e.cluster import Cluster, ClusterSpec
from tools.e2e.scenarios import prompt_ids

MAX_TOKENS = 6
# (prompt length, routed_experts_prompt_start): rows from 0, and from inside block 1.
PROMPTS = ((45, 0), (70, 33))


def check_prompt(cluster: Cluster, length: int, start: int) -> list[Check]:
    body = {"model": "tiny", "prompt": prompt_ids(31, length, length),
            "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            "routed_experts_prompt_start": start}
    name = f"P={length}, rows from {start}"
    code, reference = post_json(cluster.servers["reference"].url, "/v1/completions", body)
    if code != 200:
        return [Check(f"{name}: reference answered", False, str(reference)[:300])]
    want = decode_routed_experts(reference["choices"][0]["routed_experts"])
    chunks = post_stream(cluster.url, "/v1/completions", body)
    finals = [c["choices"][0] for c in chunks
              if c.get("choices") and c["choices"][0].get("finish_reason")]
    try:
        got = final_chunk_rows(chunks)
    except AssertionError as exc:
        return [Check(f"{name}: rows on the final chunk only", False, str(exc))]
    rows = got.get(0)
    tokens = [t for c in chunks for t in (c["choices"][0].get("token_ids") or [])
              if c.get("choices")]
    checks = [
        Check(f"{name}: one final chunk", len(finals) == 1, f"{len(finals)} final chunks"),
        Check(f"{name}: tokens equal the reference's",
              tokens == reference["choices"][0]["token_ids"],
              f"{tokens} vs {reference['choices'][0]['token_ids']}"),
        Check(f"{name}: routed_experts_start = {start}",
              bool(finals) and finals[0].get("routed_experts_start") == start,
              f"{finals[0].get('routed_experts_start') if finals else None}"),
        Check(f"{name}: {len(want)} rows equal the reference's",
              rows is not None and rows.shape == want.shape and np.array_equal(rows, want),
              "no rows" if rows is None else f"{len(rows)} rows, "
              f"{int((rows != want).any(axis=(1, 2)).sum()) if rows.shape == want.shape else '-'}"
              " differ"),
    ]
    return checks


def run(workdir: Path, router: str, transfer: bool) -> list[Check]:
    model = workdir / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    spec = ClusterSpec(model, rows_transfer=transfer, router=router)
    checks: list[Check] = []
    with Cluster(spec, workdir / "logs") as cluster:
        for length, start in PROMPTS:
            checks += check_prompt(cluster, length, start)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.e2e.pd_streaming",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", choices=("vllm-router", "pdproxy"),
                        default="vllm-router", help="what sits in front of P/D")
    parser.add_argument("--no-transfer", action="store_true",
                        help="negative control: the rows-transfer switch off on both "
                        "roles; the streamed rows are then incomplete and the run must "
                        "exit 1")
    parser.add_argument("--workdir", type=Path, help="model and server logs (default: temp)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pd-streaming-"))
    mode = "switch off (negative control)" if args.no_transfer else "rows with the KV"
    print(f"pd-streaming: {mode}, front: {args.router}, logs under {workdir}", flush=True)
    return report("pd-streaming", run(workdir, args.router, transfer=not args.no_transfer))


if __name__ == "__main__":
    sys.exit(main())
