# SPDX-License-Identifier: Apache-2.0
"""A real Mooncake store on loopback and the shapes the Mooncake benchmarks pick
from: a library of mooncake_store_rows_cost and mooncake_kv_put_latency, not a
script."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.block_bytes import PRODUCTION, Shape, tiny_shape
from tools.e2e.mooncake_master import MooncakeMaster, SegmentHolder

SEGMENT = "1GB"  # the segment holder's memory: a GLM-5 job of 8 chunks is 46 MB
LOCAL_BUFFER_BYTES = 64 << 20  # the harness's client setting (MooncakeMaster.client)
SHAPE_NAMES = ("tiny", "qwen3", "glm5")


@contextlib.contextmanager
def real_store(workdir: Path) -> Iterator[Any]:
    """Mooncake's own store on loopback: a `mooncake_master`, a segment holder with
    SEGMENT of memory, and this process's `MooncakeDistributedStore` client, which
    mounts none of its own (every object lives in the holder's segment)."""
    from mooncake.store import MooncakeDistributedStore

    master = MooncakeMaster(workdir=workdir)
    holder = SegmentHolder(master, segment=SEGMENT)
    try:
        master.start()
        holder.start()
        client = master.client()
        store = MooncakeDistributedStore()
        ret = store.setup(
            "127.0.0.1",
            client.metadata_server,
            0,  # no segment of its own: every object lives in the holder's
            LOCAL_BUFFER_BYTES,
            "tcp",
            "",
            client.master_server_address,
        )
        if ret != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {ret}")
        try:
            yield store
        finally:
            store.close()
    finally:
        holder.stop()
        master.stop()


def pick_shapes(names: list[str]) -> list[Shape]:
    production = dict(zip(SHAPE_NAMES[1:], PRODUCTION, strict=True))
    return [tiny_shape() if name == "tiny" else production[name] for name in names]


def checked(op: str, codes: list[int], want: list[int] | None = None) -> list[int]:
    bad = [code for code in codes if code < 0]
    if bad:
        raise RuntimeError(f"{op}: {len(bad)} of {len(codes)} keys failed ({set(bad)})")
    if want is not None and codes != want:
        raise RuntimeError(f"{op}: returned {codes}, expected {want}")
    return codes
