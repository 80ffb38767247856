#!/usr/bin/env python3
"""What posting the routed-experts rows READ costs decode, next to the KV READ of
the same request, over NIXL between two processes.

    .venv/bin/python -m benchmarks.nixl_rows_read [--preset deepseek-v3]
        [--blocks 32] [--block-size 32] [--kv-page-bytes 4096] [--reads 50]

A "prefill" process registers a rows mirror (the fork's `RowsMirror`, slots of
the preset's routing shape) and a KV-like region, and serves them; the "decode"
process (this one) registers the same, then per request posts the rows READ the
way `pull_worker` does (`NixlRowsTransfer.post_read`: one descriptor per pulled
block) and a KV READ of the same blocks (one descriptor per block, layer and K/V,
`--kv-page-bytes` each, as the NIXL connector's descriptor lists are laid out),
each with the agent configuration the NIXL connector uses (UCX, 4 progress
threads, telemetry), and waits for both. Per READ it reports the decode
process's CPU time (all its threads: `time.process_time`) to post and to poll
to completion, the median over `--reads` requests after a warm-up one, the rows
and KV READs alternating request by request (benchmarks/measure.py), and the
first READ separately (connection and key setup). It fails unless every READ
landed the prefill side's bytes.

This bounds one candidate cost of rows that travel with the KV: if posting the
rows READ were what made decode's worker slower than with the proxy merge, the
post would cost on the order of that difference per request.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import numpy as np

from benchmarks.measure import Result, add_json_option, run_rounds, spread, timed

TAG_FILL = 0x5A  # what the prefill side writes everywhere


@dataclass(frozen=True)
class Shape:
    num_layers: int
    top_k: int
    num_experts: int
    block_size: int
    num_blocks: int
    kv_page_bytes: int

    def rows_format(self) -> Any:
        from vllm.distributed.aux_output_connector.rows_transfer import RowsFormat

        dtype = "uint8" if self.num_experts <= 256 else "uint16"
        return RowsFormat(self.num_layers, self.top_k, dtype, self.block_size)

    @property
    def kv_descs_per_block(self) -> int:
        return self.num_layers * 2  # K and V of every layer


@dataclass(frozen=True)
class ReadCost:
    label: str
    descs: int
    nbytes: int
    first_post_ms: float
    post_ms: float
    wait_ms: float


def nixl_agent(name: str) -> Any:
    """An agent configured as the NIXL connector configures its own."""
    from nixl._api import nixl_agent as agent_cls
    from nixl._api import nixl_agent_config

    return agent_cls(name, nixl_agent_config(num_threads=4, capture_telemetry=True))


def kv_region(shape: Shape) -> np.ndarray:
    return np.zeros(shape.num_blocks * shape.kv_descs_per_block * shape.kv_page_bytes,
                    np.uint8)


def kv_descs(agent: Any, base: int, shape: Shape) -> Any:
    page = shape.kv_page_bytes
    count = shape.num_blocks * shape.kv_descs_per_block
    return agent.get_xfer_descs([(base + i * page, page, 0) for i in range(count)],
                                "DRAM")


def prefill(shape: Shape, conn: Connection) -> None:
    from vllm.distributed.aux_output_connector.rows_transfer import RowsMirror

    agent = nixl_agent("prefill")
    mirror = RowsMirror(shape.rows_format(), shape.num_blocks)
    mirror.slots[:] = TAG_FILL
    kv = kv_region(shape)
    kv[:] = TAG_FILL
    for base, nbytes in ((mirror.base_address, mirror.nbytes), (kv.ctypes.data, kv.nbytes)):
        agent.register_memory(agent.get_reg_descs([(base, nbytes, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), mirror.base_address, kv.ctypes.data))
    agent.add_remote_agent(conn.recv())
    conn.recv()  # decode is done


def timed_read(post: Any, agent: Any) -> tuple[float, float]:
    """Post one READ with `post()` (returns a handle): CPU ms to post it and to
    poll it to completion."""
    def poll(handle: Any) -> str:
        while (state := agent.check_xfer_state(handle)) not in ("DONE", "ERR"):
            pass
        return state

    post_s, handle = timed(post, clock=time.process_time)
    wait_s, state = timed(lambda: poll(handle), clock=time.process_time)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"a READ ended in state {state}")
    return post_s * 1e3, wait_s * 1e3


def measure(shape: Shape, reads: int) -> list[ReadCost]:
    from vllm.distributed.aux_output_connector.rows_transfer import RowsMirror
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.rows_transfer import (
        NixlRowsTransfer,
    )

    ours, theirs = mp.Pipe()
    peer = mp.get_context("spawn").Process(target=prefill, args=(shape, theirs))
    peer.start()
    try:
        agent = nixl_agent("decode")
        remote_meta, remote_rows, remote_kv = ours.recv()
        remote_name = agent.add_remote_agent(remote_meta)
        mirror = RowsMirror(shape.rows_format(), shape.num_blocks)
        rows = NixlRowsTransfer(agent, ["UCX"], mirror)
        kv = kv_region(shape)
        agent.register_memory(agent.get_reg_descs([(kv.ctypes.data, kv.nbytes, 0, "")],
                                                  "DRAM"))
        ours.send(agent.get_agent_metadata())
        rows.add_remote("prefill", remote_name, SimpleNamespace(
            rows_mirror_base_addr=remote_rows, rows_mirror_num_slots=shape.num_blocks))
        local_kv = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                         kv_descs(agent, kv.ctypes.data, shape))
        remote_kv_list = agent.prep_xfer_dlist(remote_name,
                                               kv_descs(agent, remote_kv, shape))
        blocks = list(range(shape.num_blocks))
        kv_ids = list(range(shape.num_blocks * shape.kv_descs_per_block))

        def post_rows() -> Any:
            return rows.post_read("prefill", blocks, blocks)

        def post_kv() -> Any:
            handle = agent.make_prepped_xfer("READ", local_kv, kv_ids, remote_kv_list,
                                             kv_ids)
            agent.transfer(handle)
            return handle

        reads_of = {"rows READ": (post_rows, mirror.slots, len(blocks)),
                    "KV READ": (post_kv, kv, len(kv_ids))}
        # The first READ of each sets up the connection and keys: reported apart.
        first = {label: timed_read(post, agent)[0] for label, (post, _, _) in reads_of.items()}
        kept = run_rounds(list(reads_of), reads,
                          lambda label, _: timed_read(reads_of[label][0], agent))
        costs = []
        for label, (_, landed, descs) in reads_of.items():
            if not (landed == TAG_FILL).all():
                raise RuntimeError(f"the {label} did not land the prefill side's bytes")
            costs.append(ReadCost(label, descs, int(landed.nbytes), first[label],
                                  spread(post for post, _ in kept[label]).median,
                                  spread(wait for _, wait in kept[label]).median))
        rows.shutdown()
        return costs
    finally:
        ours.send("done")
        peer.join(timeout=30)


def main() -> int:
    from tools.testbed.tiny_moe import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS),
                        help="routing shape of the rows slots (tools/testbed/tiny_moe.py)")
    parser.add_argument("--blocks", type=int, default=32,
                        help="KV blocks pulled per request (1,024 tokens of 32)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-page-bytes", type=int, default=4096,
                        help="bytes of one KV descriptor (one block, layer, K or V); "
                        "default: the CPU presets' (32 tokens x 1 KV head x 32 dims "
                        "x float32)")
    parser.add_argument("--reads", type=int, default=50)
    add_json_option(parser)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    shape = Shape(preset.num_layers, preset.top_k, preset.num_experts, args.block_size,
                  args.blocks, args.kv_page_bytes)
    print(f"{args.preset}: {shape.num_layers} layers x top-{shape.top_k}, "
          f"{args.blocks} blocks of {args.block_size} tokens, KV descriptors of "
          f"{args.kv_page_bytes} B; decode CPU ms per READ (median of {args.reads})")
    costs = measure(shape, args.reads)
    print(f"{'READ':10} {'descs':>6} {'bytes':>10} {'first post':>11} {'post':>8} "
          f"{'poll':>8}")
    for cost in costs:
        print(f"{cost.label:10} {cost.descs:6} {cost.nbytes:10,} {cost.first_post_ms:11.3f} "
              f"{cost.post_ms:8.3f} {cost.wait_ms:8.3f}")
    rows_cost, kv_cost = costs
    print(f"rows post / KV post: {rows_cost.post_ms / kv_cost.post_ms:.3f}")
    Result("benchmarks.nixl_rows_read", vars(args), [asdict(cost) for cost in costs],
           {"rows post / KV post": rows_cost.post_ms / kv_cost.post_ms}).emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
