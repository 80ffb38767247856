#!/usr/bin/env python3
"""Bytes moved per KV block with routed-experts rows that travel with the KV:
rows (+ tag) / KV, per block, for the served tiny model and for the shapes of
two production models.

    .venv/bin/python -m benchmarks.rows_transfer_bytes

Both sides come from the code that moves them: the rows slot from the fork's
`RowsFormat` (rows_transfer.py: block_size x layers x top_k x itemsize + the
32-byte tag), the KV page from vLLM's own `FullAttentionSpec` / `MLAAttentionSpec`
(`page_size_bytes`, per attention layer, times the layers). The tiny model's shape
is read from the checkpoint the harness serves (tools/testbed/tiny_moe.py, served in
float32 with 32-token blocks); the production shapes are written out below with
their sources and assumptions. A NIXL request moves one slot per pulled block on
TP rank 0 and the KV of every layer, so the ratio is the transfer's overhead.

    .venv/bin/python -m benchmarks.rows_transfer_bytes --measure

also counts the bytes on the wire: a P/D pair of the installed fork serves the tiny
model twice, one after the other in the same run, with the switch on and then off
(the harness's cluster, chains from `vllm kv-transfer-config`), and the same prompts
go to both. The count is NIXL's own: every finished READ's telemetry (`totalBytes`),
which decode exports as `vllm:nixl_bytes_transferred` (sum and count). Either way
decode also reads one 8-byte lease generation word per pulled block, in a READ of
its own per request (patch fail-closed-when-decode-reads-blocks-released-on). KV
bytes are the switch-off count less those words; rows bytes are on minus off. The
run fails unless the KV bytes are whole pages of ceil(P / block size) blocks per
prompt (decode pulls every block prefill filled, the partial last one too), the
rows bytes exactly one slot per pulled block, so the measured ratio equals the
computed one, and the READs two per prompt with the switch off and three with it on.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.block_bytes import (
    PRODUCTION,
    kv_bytes_per_block,
    rows_bytes_per_block,
    tiny_shape,
)


# Prompt lengths for --measure: on and off block boundaries (32-token blocks).
MEASURE_LENGTHS = (31, 32, 33, 64, 100, 257)
LEASE_WORD_BYTES = 8  # block_generations.py: one uint64 per pulled block


@dataclass(frozen=True)
class WireCount:
    """Decode's NIXL READ telemetry after the measured prompts."""

    bytes_read: int
    reads: int


def serve_and_count(model: Path, workdir: Path, routed_experts_transfer: bool) -> WireCount:
    """Send MEASURE_LENGTHS' prompts through one P/D pair; decode's NIXL count."""
    from vllm.entrypoints.routed_experts import decode_routed_experts

    from tools.e2e.cluster import Cluster
    from tools.e2e.cluster_spec import ClusterSpec
    from tools.e2e.compare import post
    from tools.e2e.scenarios import prompt_ids

    name = "switch-on" if routed_experts_transfer else "switch-off"
    cluster = Cluster(ClusterSpec(model, routed_experts_transfer=routed_experts_transfer,
                                  reference=False), workdir / name)
    try:
        cluster.start()
        for length in MEASURE_LENGTHS:
            body = {"model": "tiny", "prompt": prompt_ids(47, length, length),
                    "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                    "routed_experts_prompt_start": 0}
            choice = post(cluster.proxy_url, body, timeout=300.0)["choices"][0]
            rows = decode_routed_experts(choice).rows
            if len(rows) != length + 1:  # P + C - 1 rows from 0, C = 2
                raise RuntimeError(f"{name}, prompt of {length} tokens: {len(rows)} "
                                   f"rows, expected {length + 1}")
        # Stats reach /metrics with the engine's next logging interval.
        deadline = time.monotonic() + 60
        while True:
            count = WireCount(cluster.metric("decode", "vllm:nixl_bytes_transferred_sum"),
                              cluster.metric("decode", "vllm:nixl_bytes_transferred_count"))
            expected_reads = len(MEASURE_LENGTHS) * (3 if routed_experts_transfer else 2)
            if count.reads >= expected_reads or time.monotonic() > deadline:
                return count
            time.sleep(2)
    finally:
        cluster.stop()


def measure(workdir: Path) -> int:
    """Count rows and KV bytes on the wire for the tiny model; 0 if they match the code."""
    from tools.testbed.tiny_moe import build

    shape = tiny_shape()
    model = workdir / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    on = serve_and_count(model, workdir, routed_experts_transfer=True)
    off = serve_and_count(model, workdir, routed_experts_transfer=False)
    kv_page, slot = kv_bytes_per_block(shape), rows_bytes_per_block(shape)
    rows_bytes = on.bytes_read - off.bytes_read
    # Decode pulls every block prefill filled for the prompt, the partial last one too.
    want_blocks = sum(-(-length // shape.block_size) for length in MEASURE_LENGTHS)
    words = want_blocks * LEASE_WORD_BYTES
    blocks, partial = divmod(off.bytes_read - words, kv_page)
    print(f"prompts of {', '.join(map(str, MEASURE_LENGTHS))} tokens, rows from 0, "
          "counted by NIXL on decode (vllm:nixl_bytes_transferred)")
    print(f"  switch off: {off.bytes_read:,} B in {off.reads} READs = {blocks} KV blocks "
          f"x {kv_page:,} B" + (f" + {partial} B" if partial else "")
          + f" + {words} B of lease generation words ({want_blocks} x {LEASE_WORD_BYTES} B)")
    print(f"  switch on:  {on.bytes_read:,} B in {on.reads} READs")
    print(f"  rows bytes: {rows_bytes:,} B = {rows_bytes / slot:g} slots x {slot} B")
    print(f"  rows / KV measured {rows_bytes / off.bytes_read:.4%}, "
          f"computed {slot / kv_page:.4%}")
    problems = []
    if blocks != want_blocks:
        problems.append(f"{blocks} KV blocks pulled, expected {want_blocks} "
                        f"(sum of ceil(P / {shape.block_size}))")
    if partial or blocks == 0:
        problems.append(f"KV bytes {off.bytes_read} are not whole {kv_page}-byte pages")
    if rows_bytes != blocks * slot:
        problems.append(f"rows bytes {rows_bytes} != {blocks} pulled blocks x {slot} B")
    prompts = len(MEASURE_LENGTHS)
    if (off.reads, on.reads) != (2 * prompts, 3 * prompts):
        problems.append(f"{off.reads} / {on.reads} READs with the switch off / on, "
                        f"expected {2 * prompts} / {3 * prompts} (KV and lease words, "
                        "and the rows with the switch on)")
    for problem in problems:
        print(f"rows_transfer_bytes: MISMATCH: {problem}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true",
                        help="also serve the tiny model on P/D with the switch on and "
                        "off and count the bytes NIXL reads (a few minutes)")
    parser.add_argument("--workdir", type=Path,
                        help="model and server logs for --measure (default: temp)")
    args = parser.parse_args(argv)
    print(f"{'model':26} {'block':>5} {'rows+tag B':>10} {'KV B':>12} {'rows/KV':>8}  source")
    for shape in (tiny_shape(), *PRODUCTION):
        rows, kv = rows_bytes_per_block(shape), kv_bytes_per_block(shape)
        print(f"{shape.name:26} {shape.block_size:5d} {rows:10d} {kv:12d} "
              f"{rows / kv:8.2%}  {shape.source}")
    if args.measure:
        return measure(args.workdir or Path(tempfile.mkdtemp(prefix="rows-bytes-")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
