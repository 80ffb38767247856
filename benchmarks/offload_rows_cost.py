#!/usr/bin/env python3
"""What rows that travel with offloaded chunks add to a chunk's store and load
(patch carry-routed-experts-rows-with-offloaded-kv-chunks): time and bytes per chunk,
rows on ÷ off, for the served tiny model and two production shapes.

    .venv/bin/python -m benchmarks.offload_rows_cost [--chunks 64] [--rounds 7]

Per chunk (one KV block, the only layout the patch supports), the output rank does:

- off: the CPU tier's copy of the chunk's KV, one memmove per attention layer
  (`_swap_blocks_batch_host`, what the native offload worker runs on the CPU platform,
  patch run-the-native-offload-worker-on-the-cpu-platform);
- on, store: the same copy, then `OffloadedRowsSlots.write_stored`, which reads the
  chunk's rows from a real aux-output `BlockObjectStore` by block hash and writes the
  slot and its tag (crc32);
- on, load: the same copy, then `OffloadedRowsSlots.import_loaded`, which copies the
  slots into the rows mirror and checks every tag.

Everything runs in the same process on the same buffers, in the measuring core's
alternating rounds (benchmarks/measure.py). The KV copy (large, bandwidth-bound, noisy from round to round) and the rows
work (small, CPU-bound) are each timed alone, fastest of the rounds (contention only
adds time), and on/off = (copy + rows work) / copy; the on and off variants timed as
a whole (medians) are printed beside it. Nothing is asserted: the
numbers go to benchmarks/README.md. The KV page comes from vLLM's own
`FullAttentionSpec` / `MLAAttentionSpec`, the rows slot from the fork's `RowsFormat`
(shapes: benchmarks/rows_transfer_bytes.py). On a GPU the KV copy is a DMA over PCIe
and the rows work stays on the host, so the ratio there is not measured here.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.block_bytes import (
    PRODUCTION,
    Shape,
    kv_bytes_per_block,
    rows_bytes_per_block,
    rows_format,
    tiny_shape,
)
from benchmarks.measure import Result, add_json_option, run_rounds, spread, timed
from vllm.distributed.aux_output_connector.offload_rows import (
    ChunkRowsCheck,
    ChunkRowsSource,
    OffloadedRowsSlots,
)
from vllm.distributed.aux_output_connector.routed_experts import (
    materialize_routed_experts,
    publish_routed_experts,
    routed_experts_keys,
)
from vllm.distributed.aux_output_connector.rows_transfer import (
    RowsFormat,
    RowsMirror,
    SlotCheck,
)
from vllm.distributed.aux_output_connector.store import BlockObjectStore
from vllm.v1.kv_offload.cpu.gpu_worker import _swap_blocks_batch_host


class StoreReader:
    """Rows by block hash from a real aux-output store, as the output rank reads them."""

    def __init__(self, store: BlockObjectStore, fmt: RowsFormat) -> None:
        self.store = store
        self.fmt = fmt

    def blocks_rows(self, block_hashes: list[tuple[bytes, ...]]) -> list[np.ndarray]:
        """One read for the whole job, as AuxOutputWorkerConnector.blocks_rows does."""
        keys = [key for hashes in block_hashes
                for key in routed_experts_keys(hashes, "0")]
        rows = materialize_routed_experts(
            self.store, keys, shape_per_token=(self.fmt.num_layers, self.fmt.top_k),
            dtype=np.dtype(self.fmt.dtype))
        return list(rows.reshape(len(block_hashes), -1, *rows.shape[1:]))


def measure(shape: Shape, num_chunks: int, rounds: int) -> dict[str, float]:
    layers = shape.attention_layers
    page = kv_bytes_per_block(shape) // layers
    fmt = rows_format(shape)
    # KV: one GPU-side (here host) tensor per layer, num_chunks blocks; the CPU tier.
    gpu = [torch.randint(0, 255, (num_chunks, page), dtype=torch.uint8) for _ in range(layers)]
    cpu = torch.zeros((num_chunks, layers * page), dtype=torch.uint8)
    src = torch.tensor(
        [g.data_ptr() + b * page for b in range(num_chunks) for g in gpu], dtype=torch.int64
    )
    dst = torch.tensor(
        [cpu.data_ptr() + b * layers * page + i * page
         for b in range(num_chunks) for i in range(layers)],
        dtype=torch.int64,
    )
    sizes = torch.full((num_chunks * layers,), page, dtype=torch.int64)

    def copy_kv() -> None:
        _swap_blocks_batch_host(src, dst, sizes)

    # Rows: published in a real aux-output store, one object per block hash.
    store = BlockObjectStore(max_bytes=4 * num_chunks * fmt.rows_nbytes,
                             object_nbytes=fmt.rows_nbytes)
    rng = np.random.default_rng(0)
    hashes = [i.to_bytes(32, "little") for i in range(num_chunks)]
    blocks = [(i * fmt.block_size,
               rng.integers(0, shape.num_experts, (fmt.block_size, fmt.num_layers,
                                                   fmt.top_k)).astype(fmt.dtype))
              for i in range(num_chunks)]
    publish_routed_experts(store, batches=[(routed_experts_keys(hashes, "0"), blocks)],
                           block_size=fmt.block_size)
    mirror = RowsMirror(fmt, num_chunks)
    slots = OffloadedRowsSlots(fmt, num_chunks, mirror)
    reader = StoreReader(store, fmt)
    chunk_ids = np.arange(num_chunks)
    sources = [ChunkRowsSource(i, (hashes[i],), 1000 + i) for i in range(num_chunks)]
    checks = [ChunkRowsCheck(i, SlotCheck(i, 1000 + i, 0, fmt.block_size))
              for i in range(num_chunks)]

    def store_rows() -> None:
        assert len(slots.write_stored(chunk_ids, sources, reader)) == num_chunks

    def load_rows() -> None:
        failed, _ = slots.import_loaded(chunk_ids, checks)
        assert not failed

    def store_on() -> None:
        copy_kv()
        store_rows()

    def load_on() -> None:
        copy_kv()
        load_rows()

    store_rows()  # the slots the loads check
    variants = {"off": copy_kv, "store": store_on, "load": load_on,
                "store_rows": store_rows, "load_rows": load_rows}
    times = run_rounds(list(variants), rounds, lambda name, _: timed(variants[name])[0])
    spreads = {name: spread(values) for name, values in times.items()}
    fastest = {name: s.low for name, s in spreads.items()}
    median = {name: s.median for name, s in spreads.items()}
    copy = fastest["off"]
    return {
        "off_us": copy / num_chunks * 1e6,
        "store_rows_us": fastest["store_rows"] / num_chunks * 1e6,
        "load_rows_us": fastest["load_rows"] / num_chunks * 1e6,
        # The rows work is small and CPU-bound, the KV copy large and bandwidth-bound
        # (its round-to-round noise exceeds the rows work): each is timed on its own,
        # fastest of the rounds, and the ratio is (copy + rows work) / copy.
        "store_ratio": (copy + fastest["store_rows"]) / copy,
        "load_ratio": (copy + fastest["load_rows"]) / copy,
        # The same, timed together side by side (noisier).
        "store_ratio_median": median["store"] / median["off"],
        "load_ratio_median": median["load"] / median["off"],
        "bytes_ratio": rows_bytes_per_block(shape) / kv_bytes_per_block(shape),
        "kv_bytes": kv_bytes_per_block(shape),
        "rows_bytes": rows_bytes_per_block(shape),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=64, help="chunks per job (default 64)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    figures: dict[str, dict[str, float]] = {}
    print(f"{'shape':28} {'KV B/chunk':>11} {'rows B':>7} {'bytes':>7} "
          f"{'KV copy us':>10} {'+store us':>9} {'+load us':>8} {'store on/off':>12} "
          f"{'load on/off':>11} {'together (medians)':>18}")
    for shape in (tiny_shape(), *PRODUCTION):
        r = figures[shape.name] = measure(shape, args.chunks, args.rounds)
        print(f"{shape.name:28} {r['kv_bytes']:11,} {r['rows_bytes']:7,} "
              f"{r['bytes_ratio']:7.3%} {r['off_us']:10.1f} {r['store_rows_us']:9.1f} "
              f"{r['load_rows_us']:8.1f} {r['store_ratio']:12.3f} {r['load_ratio']:11.3f} "
              f"{r['store_ratio_median']:9.3f} {r['load_ratio_median']:8.3f}")
    print(f"per chunk, fastest of {args.rounds} rounds of {args.chunks} chunks; on/off = "
          "(KV copy + rows work) / KV copy, each timed alone; together: on and off timed "
          "as a whole, medians. Goal: on/off <= 1.05, rows bytes < 1% of the KV")
    Result("benchmarks.offload_rows_cost", vars(args), figures,
           {f"{name}: {side} (copy + rows) / copy": r[f"{side}_ratio"]
            for name, r in figures.items() for side in ("store", "load")}).emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
