# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routed-expert rows read over NIXL in the same request transfer as the KV.

Contract (``vllm/distributed/aux_output_connector/rows_transfer.py`` holds the
rows mirror and its tags):
- TP rank 0 of each instance registers its rows mirror as host memory, one
  descriptor per KV block, apart from the KV regions (the TP and region
  mapping of the KV does not apply: rows exist once, on the output rank).
- The handshake carries the rows format; the compatibility hash covers it
  only when the switch is on, so with the switch off on both sides nothing
  changes. A peer with another format (or with the switch off) is refused
  with both values named.
- Decode TP rank 0 reads the slots of the blocks it pulls from prefill TP
  rank 0 in a READ posted next to the KV READ of that request, without a
  notification: the request's notification is deferred until every READ of
  it is done, so prefill frees the blocks only after KV and rows were read,
  and decode reports the request received only when both landed.
- Before posting any READ of a request, decode clears the tags of its landing
  slots (``clear_landing_slots``): a slot no READ fills (a read plan that does
  not read rows, such as region-mapped reads) cannot pass its check with the
  rows of an earlier pull of the same tokens into the same block.
- After the READs, every slot is checked (``SlotCheck``); a slot that fails
  is a load error of its KV block (``kv_load_failure_policy``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.aux_output_connector.rows_transfer import (
    RowsMirror,
    SlotCheck,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
    )

logger = init_logger(__name__)


class NixlRowsTransfer:
    """The rows mirror's NIXL registration and reads on one worker (TP rank 0)."""

    def __init__(
        self, nixl_wrapper: Any, backends: list[str], mirror: RowsMirror
    ) -> None:
        self.mirror = mirror
        self._nixl = nixl_wrapper
        self._reg_descs = nixl_wrapper.get_reg_descs(
            [(mirror.base_address, mirror.nbytes, 0, "")], "DRAM"
        )
        nixl_wrapper.register_memory(self._reg_descs, backends=backends)
        self._local_handle = nixl_wrapper.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._slot_descs(mirror.base_address, mirror.num_blocks)
        )
        # remote engine id -> prepped dlist of its rank-0 mirror
        self._remote_handles: dict[str, int] = {}

    def _slot_descs(self, base_address: int, num_slots: int) -> Any:
        nbytes = self.mirror.format.slot_nbytes
        return self._nixl.get_xfer_descs(
            [(base_address + i * nbytes, nbytes, 0) for i in range(num_slots)],
            "DRAM",
        )

    def agent_metadata_fields(self) -> dict[str, Any]:
        return {
            "rows_mirror_base_addr": self.mirror.base_address,
            "rows_mirror_num_slots": self.mirror.num_blocks,
        }

    def add_remote(
        self, engine_id: str, remote_agent_name: str, metadata: NixlAgentMetadata
    ) -> None:
        """Prepare reads of a remote rank-0 mirror (same format: the handshake
        checked it)."""
        if engine_id in self._remote_handles or not metadata.rows_mirror_num_slots:
            return
        nbytes = self.mirror.format.slot_nbytes
        descs = self._nixl.get_xfer_descs(
            [
                (metadata.rows_mirror_base_addr + i * nbytes, nbytes, 0)
                for i in range(metadata.rows_mirror_num_slots)
            ],
            "DRAM",
        )
        self._remote_handles[engine_id] = self._nixl.prep_xfer_dlist(
            remote_agent_name, descs
        )
        logger.info(
            "Routed-experts rows travel with the KV from engine %s: %d slots of "
            "%d bytes (%s).",
            engine_id,
            metadata.rows_mirror_num_slots,
            nbytes,
            self.mirror.format.describe(),
        )

    def reads_from(self, engine_id: str) -> bool:
        return engine_id in self._remote_handles

    def clear_landing_slots(self, checks: Iterable[SlotCheck]) -> None:
        """Clear the tags of the slots a request's READs are about to fill."""
        self.mirror.invalidate([check.block_id for check in checks])

    def post_read(
        self, engine_id: str, local_block_ids: list[int], remote_block_ids: list[int]
    ) -> int:
        """Start reading the remote slots of ``remote_block_ids`` into the local
        slots of ``local_block_ids``; return the transfer handle."""
        if len(local_block_ids) != len(remote_block_ids):
            raise ValueError(
                "routed-experts rows read: "
                f"{len(local_block_ids)} local and {len(remote_block_ids)} "
                "remote blocks"
            )
        handle = self._nixl.make_prepped_xfer(
            "READ",
            self._local_handle,
            local_block_ids,
            self._remote_handles[engine_id],
            remote_block_ids,
        )
        self._nixl.transfer(handle)
        return handle

    def failed_blocks(self, request_id: str, checks: Iterable[SlotCheck]) -> set[int]:
        """The pulled blocks whose slot does not hold the rows decode needs."""
        failed: set[int] = set()
        for check in checks:
            problem = self.mirror.slot_problem(check)
            if problem is not None:
                failed.add(check.block_id)
                logger.warning(
                    "Request %s: routed-experts rows of KV block %d failed their "
                    "check (%s); the block counts as a KV load error.",
                    request_id,
                    check.block_id,
                    problem,
                )
        return failed

    def remove_remote(self, engine_id: str) -> None:
        handle = self._remote_handles.pop(engine_id, None)
        if handle is not None:
            self._nixl.release_dlist_handle(handle)

    def shutdown(self) -> None:
        for engine_id in list(self._remote_handles):
            self.remove_remote(engine_id)
        self._nixl.release_dlist_handle(self._local_handle)
        self._nixl.deregister_memory(self._reg_descs)
