#!/usr/bin/env python3
"""What routed-experts rows objects stored beside the KV chunks add to a job's store
and load in a real Mooncake store (patch
store-routed-experts-rows-beside-mooncake-store): time per chunk, rows on ÷ off, for
the served tiny model and two production shapes.

    .venv/bin/python -m benchmarks.mooncake_store_rows_cost [--chunks 8] [--rounds 7]
        [--shapes tiny,qwen3,glm5] [--kv-pieces layers|one] [--workdir DIR]

The store is Mooncake's own: a `mooncake_master` with its HTTP metadata server and a
standalone `mooncake_client` holding a 1 GB segment (tools/e2e/mooncake_master.py),
and this process's `MooncakeDistributedStore`, which mounts no memory of its own and
reads and writes over TCP on loopback, from host arrays it registered. Per job of N
chunks, as the output rank runs it (one KV object per chunk on that rank, keys built
like the connector's `PoolKey`, values from registered memory):

- off, store: `batch_is_exist` on the N KV keys, then `batch_put_from_multi_buffers`
  of the missing ones (all of them: every round stores under fresh keys);
- on, store: the same, then what the send thread's `_put_rows` adds:
  `batch_is_exist` on the N rows keys and a put of N rows objects, one rows slot
  each, from a second registered array of slots;
- off, load: the lookup (`batch_is_exist` on the N KV keys), then
  `batch_get_into_multi_buffers` of the N KV objects;
- on, load: the lookup on the 2N KV and rows keys in one call, the KV get, a get
  of the N rows objects into their slots and the check: crc32 of each slot's rows
  against the crc word of its tag.

The rows slots are written by the fork's `RowsMirror.write_whole_slots` before the
timing (the rows and their 32-byte tag, as the send thread stages them); writing
them from the aux-output store and importing them into the rows mirror are host
work that benchmarks/offload_rows_cost.py measures, not counted here. The loads
read objects stored once before the rounds; every round's stores use keys of their
own, removed after the round. By default a KV object is put from one piece per
attention layer (what `RankLocalStoreLayout.prepare_values` builds for a KV cache
with one region per layer); `--kv-pieces one` puts it from one contiguous piece.

Each round times the four variants as a whole, in the measuring core's alternating
order (benchmarks/measure.py: store off, store on, load off, load on, then the
reverse), after one round that is not timed, and inside the on variants their rows
part: the rows calls (and the check), and for a load what the longer lookup took
over the shorter one. Printed per chunk (a job's time / N), fastest of the rounds
(contention only adds time) and medians: on/off of the whole jobs, and (off + rows
part) / off, the rows part being small and RPC-bound and the KV transfer large and
noisy from round to round (the same split as benchmarks/offload_rows_cost.py), with
the rows slot's bytes against the KV object's. Shapes (KV bytes per chunk
on one rank, rows slot bytes) come from benchmarks/rows_transfer_bytes.py: vLLM's
`FullAttentionSpec` / `MLAAttentionSpec` page times the attention layers, and the
fork's `RowsFormat` slot (rows + 32-byte tag). Nothing is asserted: the numbers go
to benchmarks/README.md; a store call that fails, or a loaded object that differs
from what was stored, stops the run.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.block_bytes import Shape, kv_bytes_per_block, rows_bytes_per_block, rows_format
from benchmarks.measure import Result, add_json_option, order, spread, timed
from benchmarks.mooncake_store import SHAPE_NAMES, checked, pick_shapes, real_store
from vllm.distributed.aux_output_connector.rows_transfer import RowsFormat, RowsMirror
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    KeyMetadata,
    PoolKey,
)

TAG_CRC_WORD = 3  # rows_transfer.py: a slot's tag words end with the rows crc32


def key_prefixes(shape: Shape, fmt: RowsFormat) -> tuple[str, str]:
    """KV and rows key prefixes, as the connector builds them (TP rank 0; the rows
    namespace is the rows format's, appended to the store namespace)."""
    kv = KeyMetadata(shape.name.split()[0], 0, 0, 0, 0)
    rows_namespace = f"/r3rows-v{fmt.version}-{zlib.crc32(fmt.describe().encode()):08x}"
    rows = KeyMetadata(kv.model_name, 0, 0, 0, 0, store_namespace=rows_namespace)
    return PoolKey.build_prefix(kv), PoolKey.build_prefix(rows)


@dataclass
class Job:
    """One job's keys and where each value lies (a list of pieces per object)."""

    kv_keys: list[str]
    kv_addrs: list[list[int]]
    kv_sizes: list[list[int]]
    rows_keys: list[str]
    rows_addrs: list[list[int]]
    rows_sizes: list[list[int]]


class Bench:
    """One shape's registered arrays and the four timed variants of a job."""

    def __init__(self, store, shape: Shape, num_chunks: int, pieces: str) -> None:
        self.store = store
        self.num_chunks = num_chunks
        self.fmt = rows_format(shape)
        self.kv_nbytes = kv_bytes_per_block(shape)
        self.slot_nbytes = rows_bytes_per_block(shape)
        assert self.slot_nbytes == self.fmt.slot_nbytes
        self.num_pieces = shape.attention_layers if pieces == "layers" else 1
        self.piece = self.kv_nbytes // self.num_pieces
        assert self.piece * self.num_pieces == self.kv_nbytes
        rng = np.random.default_rng(0)
        # KV: the source of stores and the destination of loads, piece p of chunk c
        # at p * region + c * piece (one region per layer, blocks inside it).
        self.kv_src = rng.integers(0, 256, num_chunks * self.kv_nbytes, np.uint8)
        self.kv_dst = np.zeros_like(self.kv_src)
        # Rows: the slots a store puts from (written with real rows and tags) and
        # the slots a load gets into.
        self.slots_src = RowsMirror(self.fmt, num_chunks)
        rows_shape = (self.fmt.block_size, self.fmt.num_layers, self.fmt.top_k)
        self.slots_src.write_whole_slots(
            list(range(num_chunks)),
            [int(c) for c in rng.integers(0, 1 << 63, num_chunks)],
            [
                rng.integers(0, shape.num_experts, rows_shape).astype(self.fmt.dtype)
                for _ in range(num_chunks)
            ],
        )
        self.slots_dst = RowsMirror(self.fmt, num_chunks)
        self.registered = [
            (int(a.ctypes.data), int(a.nbytes))
            for a in (
                self.kv_src,
                self.kv_dst,
                self.slots_src.slots,
                self.slots_dst.slots,
            )
        ]
        for address, nbytes in self.registered:
            if store.register_buffer(address, nbytes) != 0:
                raise RuntimeError(f"register_buffer of {nbytes} B failed")
        self.kv_prefix, self.rows_prefix = key_prefixes(shape, self.fmt)
        self.loaded = self.job("load", self.kv_dst, self.slots_dst)

    def close(self) -> None:
        for address, _ in self.registered:
            self.store.unregister_buffer(address)

    def job(self, tag: str, kv: np.ndarray, slots: RowsMirror) -> Job:
        region = self.num_chunks * self.piece
        kv_base, slots_base = int(kv.ctypes.data), slots.base_address
        hashes = [
            hashlib.sha256(f"{tag}/{c}".encode()).hexdigest()
            for c in range(self.num_chunks)
        ]
        chunks = range(self.num_chunks)
        return Job(
            [PoolKey.build_key_string(self.kv_prefix, h) for h in hashes],
            [
                [kv_base + p * region + c * self.piece for p in range(self.num_pieces)]
                for c in chunks
            ],
            [[self.piece] * self.num_pieces for _ in chunks],
            [PoolKey.build_key_string(self.rows_prefix, h) for h in hashes],
            [[slots_base + c * self.slot_nbytes] for c in chunks],
            [[self.slot_nbytes] for _ in chunks],
        )

    def put(self, keys, addrs, sizes) -> None:
        """The send thread's pattern: which objects are missing, then put those."""
        exists = checked("batch_is_exist", self.store.batch_is_exist(keys))
        missing = [i for i, state in enumerate(exists) if state != 1]
        checked(
            "batch_put_from_multi_buffers",
            self.store.batch_put_from_multi_buffers(
                [keys[i] for i in missing],
                [addrs[i] for i in missing],
                [sizes[i] for i in missing],
            ),
        )

    def store_job(self, job: Job, rows: bool, parts: dict[str, float]) -> int:
        self.put(job.kv_keys, job.kv_addrs, job.kv_sizes)
        if rows:
            parts["rows"], _ = timed(lambda: self.put(job.rows_keys, job.rows_addrs,
                                                      job.rows_sizes))
        return 0

    def load_job(self, rows: bool, parts: dict[str, float]) -> int:
        """Lookup, KV get and (rows on) rows get and check; the slots that failed."""
        job, n = self.loaded, self.num_chunks
        keys = job.kv_keys + job.rows_keys if rows else job.kv_keys
        parts["lookup"], _ = timed(lambda: checked(
            "batch_is_exist", self.store.batch_is_exist(keys), [1] * len(keys)))
        checked(
            "batch_get_into_multi_buffers (KV)",
            self.store.batch_get_into_multi_buffers(
                job.kv_keys, job.kv_addrs, job.kv_sizes
            ),
            [self.kv_nbytes] * n,
        )
        if not rows:
            return 0

        def rows_get_and_check() -> int:
            checked(
                "batch_get_into_multi_buffers (rows)",
                self.store.batch_get_into_multi_buffers(
                    job.rows_keys, job.rows_addrs, job.rows_sizes
                ),
                [self.slot_nbytes] * n,
            )
            rows_nbytes = self.fmt.rows_nbytes
            slots = self.slots_dst.slots
            crcs = slots[:, rows_nbytes:].view(np.uint64)[:, TAG_CRC_WORD]
            return sum(
                zlib.crc32(slots[c, :rows_nbytes]) != int(crcs[c]) for c in range(n)
            )

        parts["rows"], failed = timed(rows_get_and_check)
        return failed

    def remove(self, keys: list[str]) -> None:
        checked("batch_remove", self.store.batch_remove(keys, True))

    def prepare_loads(self) -> None:
        """Store the objects every load reads; check one load of them."""
        source = self.job("load", self.kv_src, self.slots_src)
        self.store_job(source, rows=True, parts={})
        failed = self.load_job(rows=True, parts={})
        if failed or not np.array_equal(self.kv_dst, self.kv_src):
            raise RuntimeError("a loaded object differs from the one stored")
        if not np.array_equal(self.slots_dst.slots, self.slots_src.slots):
            raise RuntimeError("a loaded rows slot differs from the one stored")

    def round(self, index: int, kept: dict[str, list[float]] | None) -> None:
        jobs = {
            rows: self.job(f"store {index} {rows}", self.kv_src, self.slots_src)
            for rows in (False, True)
        }
        ops: dict[str, Callable[[dict[str, float]], int]] = {
            "store_off": lambda parts: self.store_job(jobs[False], False, parts),
            "store_on": lambda parts: self.store_job(jobs[True], True, parts),
            "load_off": lambda parts: self.load_job(False, parts),
            "load_on": lambda parts: self.load_job(True, parts),
        }
        for name in order(list(ops), index):
            parts: dict[str, float] = {}
            elapsed, failed = timed(lambda n=name, p=parts: ops[n](p))
            if failed:
                raise RuntimeError(f"{name}: {failed} rows slots failed their check")
            if kept is not None:
                kept.setdefault(name, []).append(elapsed)
                for part, seconds in parts.items():
                    kept.setdefault(f"{name} {part}", []).append(seconds)
        self.remove(jobs[False].kv_keys + jobs[True].kv_keys + jobs[True].rows_keys)


def measure(store, shape: Shape, num_chunks: int, rounds: int, pieces: str) -> dict:
    bench = Bench(store, shape, num_chunks, pieces)
    try:
        bench.prepare_loads()
        bench.round(-1, None)  # warm-up, not timed
        kept: dict[str, list[float]] = {}
        for index in range(rounds):
            bench.round(index, kept)
        bench.remove(bench.loaded.kv_keys + bench.loaded.rows_keys)
    finally:
        bench.close()
    spreads = {name: spread(values) for name, values in kept.items()}
    f = {name: s.low / num_chunks * 1e6 for name, s in spreads.items()}
    m = {name: s.median / num_chunks * 1e6 for name, s in spreads.items()}
    # The rows part of an "on" job timed inside it: its rows calls (and, for a
    # load, what the longer lookup added), fastest of the rounds.
    rows_store = f["store_on rows"]
    rows_load = f["load_on rows"] + max(0.0, f["load_on lookup"] - f["load_off lookup"])
    return {
        "kv_bytes": bench.kv_nbytes,
        "rows_bytes": bench.slot_nbytes,
        "pieces": bench.num_pieces,
        "fastest": f,
        "median": m,
        "store_ratio": f["store_on"] / f["store_off"],
        "load_ratio": f["load_on"] / f["load_off"],
        "store_ratio_median": m["store_on"] / m["store_off"],
        "load_ratio_median": m["load_on"] / m["load_off"],
        "rows_store": rows_store,
        "rows_load": rows_load,
        "store_ratio_parts": (f["store_off"] + rows_store) / f["store_off"],
        "load_ratio_parts": (f["load_off"] + rows_load) / f["load_off"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=8, help="chunks per job (8)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (7)")
    parser.add_argument(
        "--shapes",
        default=",".join(SHAPE_NAMES),
        help=f"comma-separated, of {', '.join(SHAPE_NAMES)} (all)",
    )
    parser.add_argument(
        "--kv-pieces",
        choices=("layers", "one"),
        default="layers",
        help="a KV object's pieces: one per attention layer (default), or one",
    )
    parser.add_argument(
        "--workdir", type=Path, help="the store's logs (default: a new temp dir)"
    )
    add_json_option(parser)
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.shapes.split(",") if name.strip()]
    unknown = sorted(set(names) - set(SHAPE_NAMES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; pick from {', '.join(SHAPE_NAMES)}")
    shapes = pick_shapes(names)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mooncake-rows-cost-"))

    results = []
    with real_store(workdir) as store:
        for shape in shapes:
            results.append(
                (shape, measure(store, shape, args.chunks, args.rounds, args.kv_pieces))
            )

    print(
        f"{'shape':24} {'KV B/chunk':>11} {'rows B':>7} {'rows/KV':>7} {'pieces':>6} "
        f"{'store off':>9} {'on':>8} {'load off':>9} {'on':>8} "
        f"{'store on/off':>12} {'load on/off':>11}"
    )
    for shape, r in results:
        f = r["fastest"]
        print(
            f"{shape.name:24} {r['kv_bytes']:11,} {r['rows_bytes']:7,} "
            f"{r['rows_bytes'] / r['kv_bytes']:7.2%} {r['pieces']:6} "
            f"{f['store_off']:9.1f} {f['store_on']:8.1f} "
            f"{f['load_off']:9.1f} {f['load_on']:8.1f} "
            f"{r['store_ratio']:12.3f} {r['load_ratio']:11.3f}"
        )
    print(
        f"\n{'shape':24} {'median store off':>16} {'on':>8} {'load off':>9} "
        f"{'on':>8} {'on/off s / l':>13} {'rows part s / l':>16} "
        f"{'(off+part)/off':>14}"
    )
    for shape, r in results:
        m = r["median"]
        print(
            f"{shape.name:24} {m['store_off']:16.1f} {m['store_on']:8.1f} "
            f"{m['load_off']:9.1f} {m['load_on']:8.1f} "
            f"{r['store_ratio_median']:6.3f} {r['load_ratio_median']:6.3f} "
            f"{r['rows_store']:7.1f} {r['rows_load']:8.1f} "
            f"{r['store_ratio_parts']:6.3f} {r['load_ratio_parts']:7.3f}"
        )
    print(
        f"\nµs per chunk (a job is {args.chunks} chunks: x {args.chunks} per job); "
        f"first table: fastest of {args.rounds} rounds, on/off of the fastest jobs; "
        "second: medians, and the rows part of the on jobs timed inside them "
        "(fastest), (off + rows part) / off. Mooncake store over TCP on loopback. "
        "Goal: on/off <= 1.05"
    )
    print(f"store logs: {workdir}")
    Result("benchmarks.mooncake_store_rows_cost", vars(args),
           {shape.name: r for shape, r in results},
           {f"{shape.name}: {side} on / off": r[f"{side}_ratio"]
            for shape, r in results for side in ("store", "load")}).emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
