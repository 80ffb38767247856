#!/usr/bin/env python3
"""How long the Mooncake store's KV put takes with routed-experts rows on ÷ off, when
the rows come late and when they never come (patch
store-routed-experts-rows-beside-mooncake-store; the proof that the KV put never
waits for rows).

    .venv/bin/python -m benchmarks.mooncake_kv_put_latency [--shape qwen3|glm5|tiny]
        [--chunks 8] [--jobs 120] [--interval 0.1] [--rows-delay 10] [--rounds 3]

What runs is the fork's own code against Mooncake's own store: vLLM's
`KVCacheStoreSendingThread` handles each store job (`_handle_request`: the lookup
of the job's KV keys, the put of the missing ones from registered memory, the job's
completion, which releases its KV blocks), and with rows on the output rank's
`StoreRowsPutter` runs on its thread beside it, as in a server. The store is a real
`mooncake_master` with a segment holder over TCP on loopback
(benchmarks/mooncake_store_rows_cost.py's `real_store`). Modes, each a block of
`--jobs` jobs of `--chunks` chunks, one every `--interval` seconds:

- off: no rows putter, the jobs carry no rows (a server without routed experts);
- ready: the rows of each job's chunks are published when the job is queued;
- late: they are published `--rows-delay` seconds after it (10 s: a planted delay
  as long as the putter's `ROWS_WAIT_SECONDS`); with the defaults the first rows
  arrive, and are put, while later jobs' KV puts run;
- aborted: they never come (an aborted request never publishes its rows); the
  putter holds every chunk until its deadline, then gives it up.

The engine commits a step every STEP_SECONDS (what the putter watches before it asks
for rows again). The timed span is `_handle_request` alone, on the benchmark's
thread: the KV put as the send thread performs it, with the putter thread competing
for the interpreter and the store client. Each job's KV keys are removed after it
(not timed); the blocks' order is mirrored every other round (benchmarks/measure.py),
so drift falls on every mode alike.
Printed per mode: median and 90th percentile of the job latency, the median ÷ off,
and what the putter did (rows objects found in the store at the block's end, chunks
still waiting, chunks given up). Goal: median on ÷ off <= 1.05 in every mode. Nothing
is asserted; a store call that fails, or a job that does not complete, stops the run.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.block_bytes import Shape, kv_bytes_per_block, rows_format
from benchmarks.measure import Result, add_json_option, run_rounds, spread, timed
from benchmarks.mooncake_store import SHAPE_NAMES, checked, pick_shapes, real_store
from vllm.distributed.aux_output_connector.rows_transfer import RowsMirror
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    ChunkedTokenDatabase,
    KeyMetadata,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.rows import (
    ROWS_WAIT_SECONDS,
    StoreRowsJob,
    StoreRowsPutter,
    StoreRowsSlots,
    rows_key_prefix,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    KVCacheStoreSendingThread,
    MooncakeStoreCoordinator,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

MODES = ("off", "ready", "late", "aborted")
# One engine step per 20 ms: how often the auxiliary-output store commits outputs.
STEP_SECONDS = 0.02
NEVER = float("inf")


class LateRows:
    """The auxiliary-output store as the putter reads it: each block hash's rows
    become readable at their publication time (never, for an aborted request)."""

    def __init__(self) -> None:
        self._rows: dict[bytes, tuple[float, np.ndarray]] = {}
        self._lock = threading.Lock()

    def publish_at(self, rows_by_hash: dict[bytes, np.ndarray], when: float) -> None:
        with self._lock:
            self._rows.update({h: (when, r) for h, r in rows_by_hash.items()})

    def outputs_committed(self) -> int:
        return int(time.monotonic() / STEP_SECONDS)

    def blocks_rows(
        self, block_hashes: Sequence[Sequence[bytes]]
    ) -> list[np.ndarray | None]:
        now = time.monotonic()
        with self._lock:
            found = []
            for hashes in block_hashes:
                parts = [self._rows.get(bytes(h)) for h in hashes]
                ready = all(p is not None and p[0] <= now for p in parts)
                found.append(
                    np.concatenate([p[1] for p in parts if p is not None])
                    if ready
                    else None
                )
            return found


@dataclass
class Block:
    """One mode's block of jobs: their latencies and what the putter did."""

    mode: str
    latencies: list[float] = field(default_factory=list)
    rows_objects: int = 0
    waiting: int = 0
    given_up: int = 0


class Rig:
    """A shape's registered KV, and a send thread (with a rows putter for the
    modes with rows) per block, over one KV cache group of full attention."""

    def __init__(self, store: Any, shape: Shape, num_chunks: int) -> None:
        self.store = store
        self.shape = shape
        self.num_chunks = num_chunks
        self.block_size = shape.block_size
        self.fmt = rows_format(shape)
        self.metadata = KeyMetadata(shape.name.split()[0], 0, 0, 0, 0)
        layers = shape.attention_layers
        self.piece = kv_bytes_per_block(shape) // layers
        # One region per attention layer, one piece per block in each.
        rng = np.random.default_rng(0)
        self.kv = rng.integers(0, 256, layers * num_chunks * self.piece, np.uint8)
        self.region_addrs = [
            int(self.kv.ctypes.data) + layer * num_chunks * self.piece
            for layer in range(layers)
        ]
        if store.register_buffer(int(self.kv.ctypes.data), int(self.kv.nbytes)) != 0:
            raise RuntimeError(f"register_buffer of {self.kv.nbytes} B failed")
        self.rows_shape = (self.block_size, self.fmt.num_layers, self.fmt.top_k)
        self.rng = rng
        self.next_job_id = 0

    def close(self) -> None:
        self.store.unregister_buffer(int(self.kv.ctypes.data))

    def send_thread(self, putter: StoreRowsPutter | None) -> KVCacheStoreSendingThread:
        from mooncake.store import ReplicateConfig

        db = ChunkedTokenDatabase(self.metadata, block_size=self.block_size)
        db.set_kv_caches_base_addr(self.region_addrs)
        db.set_block_len([self.piece])
        spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.shape.num_kv_heads or 1,
            head_size=self.shape.head_size,
            dtype=self.shape.kv_dtype,
        )
        coord = MooncakeStoreCoordinator(
            [KVCacheGroupSpec(["layer0"], spec)],
            scheduler_block_size=self.block_size,
            hash_block_size=self.block_size,
        )
        thread = KVCacheStoreSendingThread(
            store=self.store,
            coord=coord,
            token_databases=[db],
            block_size=self.block_size,
            tp_rank=0,
            group_put_steps=[1],
            kv_role="kv_producer",
            ready_event=threading.Event(),
            replicate_config=ReplicateConfig(),
            rows_putter=putter,
        )
        # The benchmark's thread plays the send thread's loop: one job at a time.
        thread.request_queue.task_done = lambda: None  # type: ignore[method-assign]
        return thread

    def putter(self, reader: LateRows) -> tuple[StoreRowsPutter, StoreRowsSlots]:
        slots = StoreRowsSlots(
            self.fmt,
            self.num_chunks,
            RowsMirror(self.fmt, self.num_chunks),
            rows_key_prefix(self.metadata, self.fmt),
        )
        slots.register(self.store)

        def put(keys: list[str], addrs: list[list[int]], sizes: list[list[int]]):
            return self.store.batch_put_from_multi_buffers(keys, addrs, sizes)

        putter = StoreRowsPutter(slots, self.store, put, lambda: reader)
        putter.register()
        return putter, slots

    def job(self, label: str, rows: bool) -> tuple[ReqMeta, list[bytes]]:
        hashes = [
            hashlib.sha256(f"{label}/{c}".encode()).digest()
            for c in range(self.num_chunks)
        ]
        chains = tuple(int(c) for c in self.rng.integers(1, 1 << 62, self.num_chunks))
        self.next_job_id += 1
        req = ReqMeta(
            req_id=label,
            token_len_chunk=self.num_chunks * self.block_size,
            block_ids=(list(range(self.num_chunks)),),
            block_hashes=hashes,  # type: ignore[arg-type]
            can_save=True,
            store_job_id=self.next_job_id,
            # Every chunk computed by the job's own step: its rows come after it.
            rows=StoreRowsJob(chains=chains, computed_from=0) if rows else None,
        )
        return req, hashes

    def run_block(
        self, mode: str, round_index: int, jobs: int, interval: float, delay: float
    ) -> Block:
        block = Block(mode)
        reader = LateRows()
        putter, slots = (None, None) if mode == "off" else self.putter(reader)
        thread = self.send_thread(putter)
        if putter is not None:
            putter.start()
        rows_keys: list[str] = []
        try:
            for index in range(jobs):
                started = time.monotonic()
                req, hashes = self.job(f"{mode}-{round_index}-{index}", putter is not None)
                if slots is not None:
                    when = {"ready": started, "late": started + delay}.get(mode, NEVER)
                    reader.publish_at(
                        {
                            h: self.rng.integers(
                                0, self.shape.num_experts, self.rows_shape
                            ).astype(self.fmt.dtype)
                            for h in hashes
                        },
                        when,
                    )
                    rows_keys += [slots.key(h) for h in hashes]
                thread.add_request(req)
                queued = thread.request_queue.get()
                seconds, _ = timed(lambda q=queued: thread._handle_request(q))
                block.latencies.append(seconds)
                done = thread.take_completed_saves()
                if done != {req.store_job_id: 1}:
                    raise RuntimeError(f"{mode} job {index}: completed saves {done}")
                self.remove([thread.token_databases[0].key_for(h) for h in hashes])
                time.sleep(max(0.0, started + interval - time.monotonic()))
            if putter is not None:
                block.waiting = putter.waiting
                block.given_up = putter.given_up
                block.rows_objects = sum(
                    state == 1 for state in self.store.batch_is_exist(rows_keys)
                )
        finally:
            if putter is not None:
                putter.close()
            if rows_keys:
                self.remove(rows_keys)
            if slots is not None:
                self.store.unregister_buffer(slots.staging.base_address)
                self.store.unregister_buffer(putter.staging.base_address)
        return block

    def remove(self, keys: list[str]) -> None:
        exists = self.store.batch_is_exist(keys)
        present = [k for k, state in zip(keys, exists, strict=True) if state == 1]
        if present:
            checked("batch_remove", self.store.batch_remove(present, True))


def summarise(blocks: list[Block]) -> dict[str, dict[str, float]]:
    by_mode: dict[str, dict[str, float]] = {}
    for mode in MODES:
        mine = [b for b in blocks if b.mode == mode]
        latencies = sorted(x for b in mine for x in b.latencies)
        by_mode[mode] = {
            "median": spread(latencies).median * 1e3,
            "p90": latencies[int(0.9 * (len(latencies) - 1))] * 1e3,
            "rows_objects": sum(b.rows_objects for b in mine),
            "waiting": sum(b.waiting for b in mine),
            "given_up": sum(b.given_up for b in mine),
            "jobs": len(latencies),
        }
    off = by_mode["off"]["median"]
    for mode in MODES:
        by_mode[mode]["ratio"] = by_mode[mode]["median"] / off
    return by_mode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mooncake_kv_put_latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shape", choices=SHAPE_NAMES, default="qwen3",
                        help="KV and rows shape per chunk (qwen3: Qwen3-30B-A3B)")
    parser.add_argument("--chunks", type=int, default=8, help="chunks per job (8)")
    parser.add_argument("--jobs", type=int, default=120, help="jobs per block (120)")
    parser.add_argument("--interval", type=float, default=0.1,
                        help="seconds between jobs (0.1)")
    parser.add_argument("--rows-delay", type=float, default=ROWS_WAIT_SECONDS,
                        help="mode late: seconds from a job to its rows "
                        f"(the putter's ROWS_WAIT_SECONDS, {ROWS_WAIT_SECONDS:g})")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four blocks (3)")
    parser.add_argument("--workdir", type=Path,
                        help="the store's logs (default: a new temp dir)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    for name in ("chunks", "jobs", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be 1 or more")
    if args.interval < 0 or args.rows_delay < 0:
        parser.error("--interval and --rows-delay are seconds, 0 or more")
    (shape,) = pick_shapes([args.shape])
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mooncake-kv-put-"))
    blocks: list[Block] = []
    with real_store(workdir) as store:
        rig = Rig(store, shape, args.chunks)
        try:
            rig.run_block("off", -1, min(args.jobs, 5), 0.0, 0.0)  # warm-up, not kept
            by_mode = run_rounds(MODES, args.rounds, lambda mode, round_index: rig.run_block(
                mode, round_index, args.jobs, args.interval, args.rows_delay))
            blocks = [block for mode in MODES for block in by_mode[mode]]
        finally:
            rig.close()
    result = summarise(blocks)
    print(f"shape: {shape.name}; {args.chunks} chunks per job, "
          f"{kv_bytes_per_block(shape) * args.chunks:,} B of KV per job, "
          f"{args.jobs} jobs per block every {args.interval:g} s, "
          f"{args.rounds} rounds; rows delay (late) {args.rows_delay:g} s")
    print(f"{'mode':8} {'jobs':>5} {'median ms':>9} {'p90 ms':>8} {'÷ off':>6} "
          f"{'rows objects':>12} {'waiting':>7} {'given up':>8}")
    for mode in MODES:
        r = result[mode]
        print(f"{mode:8} {r['jobs']:5.0f} {r['median']:9.2f} {r['p90']:8.2f} "
              f"{r['ratio']:6.3f} {r['rows_objects']:12.0f} {r['waiting']:7.0f} "
              f"{r['given_up']:8.0f}")
    worst = max(result[m]["ratio"] for m in MODES[1:])
    print(f"goal: median KV put with rows ÷ off <= 1.05 in every mode: "
          f"{'met' if worst <= 1.05 else 'missed'} (worst {worst:.3f})")
    print(f"store logs: {workdir}")
    Result("benchmarks.mooncake_kv_put_latency", vars(args), result,
           {f"{mode}: median ÷ off": result[mode]["ratio"] for mode in MODES[1:]}
           ).emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
