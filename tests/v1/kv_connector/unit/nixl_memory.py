"""A NIXL agent stand-in for unit tests: READs copy registered host memory with
`ctypes.memmove`, so landing slots and the checks on them run exactly as over a
real transport."""

from __future__ import annotations

import ctypes
from typing import Any


class MemoryNixl:
    """NIXL stand-in: descriptors are (address, length, device) tuples and a
    transfer copies the remote descriptors' bytes into the local ones. A
    strided row (address, length, device, stride, count) stands for `count`
    descriptors `stride` bytes apart, as NIXL indexes it."""

    def __init__(self, lands: bool = True) -> None:
        self.lands = lands
        self.registered: list[Any] = []
        self.dlists: dict[int, list[tuple[int, int, int]]] = {}
        self.xfers: dict[int, tuple[int, list[int], int, list[int]]] = {}
        self._next = 0

    def _handle(self) -> int:
        self._next += 1
        return self._next

    def get_reg_descs(self, regions: list[Any], mem: str) -> list[Any]:
        assert mem == "DRAM"
        return list(regions)

    def register_memory(self, descs: list[Any], backends: Any = None) -> None:
        self.registered.append(descs)

    def deregister_memory(self, descs: list[Any]) -> None:
        self.registered.remove(descs)

    def get_xfer_descs(self, descs: list[Any], mem: str) -> list[Any]:
        return list(descs)

    def prep_xfer_dlist(self, agent: str, descs: Any, mem_type: str = "DRAM") -> int:
        assert mem_type == "DRAM"
        rows = [tuple(int(v) for v in row) for row in descs]
        if rows and len(rows[0]) == 5:
            rows = [
                (addr + i * stride, length, dev)
                for addr, length, dev, stride, count in rows
                for i in range(count)
            ]
        handle = self._handle()
        self.dlists[handle] = rows
        return handle

    def release_dlist_handle(self, handle: int) -> None:
        del self.dlists[handle]

    def make_prepped_xfer(
        self, op, local, local_ids, remote, remote_ids, notif_msg=b""
    ):
        assert op == "READ" and notif_msg == b""
        handle = self._handle()
        self.xfers[handle] = (local, list(local_ids), remote, list(remote_ids))
        return handle

    def transfer(self, handle: int) -> None:
        if not self.lands:
            return
        local, local_ids, remote, remote_ids = self.xfers[handle]
        for li, ri in zip(local_ids, remote_ids):
            (dst, n, _), (src, m, _) = self.dlists[local][li], self.dlists[remote][ri]
            assert n == m, (n, m)
            ctypes.memmove(dst, src, n)
