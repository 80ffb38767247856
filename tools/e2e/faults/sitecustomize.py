"""Planted faults for the equivalence harness's negative controls.

Loaded only when the harness puts this directory on PYTHONPATH of a server it
starts, with E2E_FAULT naming the fault. Each fault patches its modules (one,
or one per connector it applies to) right after they are imported, in every
process of that server (API server, engine core), and nothing else. This file is test tooling; it is never part of the
fork wheel.

The list of faults, with what each is for, is tools/e2e/fault_registry.py; this file
runs inside the servers without the repository on the path, so it keeps its own
table of what to patch, and tests/tools/test_fault_registry.py holds the two to the
same names.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, patch: Callable[[ModuleType], None]) -> None:
        self.target, self.patch = target, patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            self.patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _no_floor(module: ModuleType) -> None:
    # The decode emit floor is gone: decode asks for rows it never computed.
    module.AuxOutputSchedulerConnector._decode_emit_floor = lambda self, request: None


def _leak_floors(module: ModuleType) -> None:
    # A finished request keeps its decode emit floor: rows stay right, state leaks.
    connector = module.AuxOutputSchedulerConnector
    original = connector.request_finished

    def request_finished(self: Any, request: Any) -> None:
        floor = self._decode_emit_floors.get(request.request_id)
        original(self, request)
        if floor is not None:
            self._decode_emit_floors[request.request_id] = floor

    connector.request_finished = request_finished


def _no_skip(module: ModuleType) -> None:
    # The worker no longer skips the partially computed first block.
    module._first_capture_starts_mid_block = lambda *args: False


def _shift_decode_rows(module: ModuleType) -> None:
    # Every routed-experts array this server returns is shifted by one position.
    import numpy as np

    original = module.numpy2base64

    def shifted(array: Any) -> str:
        if isinstance(array, np.ndarray) and array.ndim == 3 and len(array) > 1:
            array = np.concatenate([array[1:], array[-1:]])
        return original(array)

    module.numpy2base64 = shifted


def _no_clamp(module: ModuleType) -> None:
    # KV-offload loads are no longer limited to the positions before the prompt start.
    module.aux_output_load_limit = lambda *args: None


def _no_row_transfer(module: ModuleType) -> None:
    # Decode skips the rows READ beside the KV READ; its slots keep what they held.
    module.NixlRowsTransfer.reads_from = lambda self, engine_id: False


def _corrupt_row_tag(module: ModuleType) -> None:
    # The first slot decode checks after each pull has a wrong token chain in its tag.
    original = module.NixlRowsTransfer.failed_blocks

    def failed_blocks(self: Any, request_id: str, checks: Any) -> set[int]:
        checks = tuple(checks)
        if checks:
            tag = self.mirror.slots[checks[0].block_id, self.mirror.format.rows_nbytes:]
            tag.view("uint64")[2] ^= 1
        return original(self, request_id, checks)

    module.NixlRowsTransfer.failed_blocks = failed_blocks


def _rows_not_imported(module: ModuleType) -> None:
    # Offload loads no longer hand their chunks' rows to the capture: the loaded
    # positions have no rows where the request emits them.
    module.OffloadingConnector.loads_routed_experts_rows = lambda self, request: False


def _store_rows_not_imported(module: ModuleType) -> None:
    # The same for the Mooncake store's loads and their rows objects.
    module.MooncakeStoreConnector.loads_routed_experts_rows = lambda self, request: False


def _corrupt_store_rows(module: ModuleType) -> None:
    # The first rows object each Mooncake store load checks has a wrong token chain
    # in its tag.
    original = module.StoreRowsSlots.check_loaded

    def check_loaded(self: Any, checks: Any, get: Any, results: Any) -> Any:
        if len(checks) and results[0] >= 0:
            tag = self.staging.slots[checks[0][1].block_id, self.format.rows_nbytes:]
            tag.view("uint64")[2] ^= 1
        return original(self, checks, get, results)

    module.StoreRowsSlots.check_loaded = check_loaded


def _corrupt_rows(module: ModuleType) -> None:
    # The first offloaded chunk each load checks has a wrong token chain in its tag.
    original = module.OffloadedRowsSlots.import_loaded

    def import_loaded(self: Any, chunk_ids: Any, checks: Any) -> Any:
        checks = tuple(checks)
        if checks:
            slots = self.slots
            tag = slots.slots[int(chunk_ids[checks[0].position]), slots.format.rows_nbytes:]
            tag.view("uint64")[2] ^= 1
        return original(self, chunk_ids, checks)

    module.OffloadedRowsSlots.import_loaded = import_loaded


def _no_lease_check(module: ModuleType) -> None:
    # Decode no longer compares the lease generation words it read (the old
    # behaviour): a KV read of blocks released on lease expiry is trusted.
    module.NixlBlockGenerations.finish = (
        lambda self, request_id: self.forget(request_id)
    )


def _unbounded_pd_decode_loads(module: ModuleType) -> None:
    # Every P/D decode request keeps the offload-limit exemption, even when its
    # prompt rows travel with the KV (the old behaviour): a reload through the
    # Mooncake store or an offload tier covers positions whose rows are returned.
    module.emits_from_first_forward = module.is_pd_decode_request


def _hold_finished_blocks(module: ModuleType) -> None:
    # Every finished request's blocks wait for a store completion that never comes:
    # tokens and rows stay right, the KV cache leaks.
    module.OffloadingConnectorScheduler.request_finished = lambda self, request: (True, None)


def _uncapped_store_lookups(module: ModuleType) -> None:
    # The Mooncake store's lookups no longer end before chunks whose load failed
    # (the old behaviour): under recompute a request whose first chunk fails loads
    # it again every step.
    module.StoreLoadFailures.cap_lookup = (
        lambda self, request, block_hashes, num_computed_tokens: block_hashes
    )


_STORE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"
def _reversed_role_chains(module: ModuleType) -> None:
    # The kv-transfer-config builder prints every chain in reverse order (NIXL
    # last): the golden file of tests/distributed/kv_transfer/test_role_chains.py
    # must catch it.
    original = module.wrap_chain
    module.wrap_chain = lambda chain: original(chain[::-1])


def _unshared_handoff_loads(module: ModuleType) -> None:
    # Decode's scheduler sees no hand-off key: every child of an n > 1 request
    # pulls the hand-off, the later ones after prefill freed its blocks.
    module.NixlPullConnectorScheduler.shared_load_key = lambda self, request: None


FAULTS: dict[str, tuple[str, Callable[[ModuleType], None]]] = {
    "no-floor": ("vllm.distributed.aux_output_connector.connector", _no_floor),
    "no-skip": ("vllm.distributed.aux_output_connector.worker", _no_skip),
    "leak-floors": ("vllm.distributed.aux_output_connector.connector", _leak_floors),
    "shift-decode-rows": ("vllm.utils.serial_utils", _shift_decode_rows),
    "no-clamp": ("vllm.distributed.aux_output_connector.offload", _no_clamp),
    "no-row-transfer": ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.rows_transfer",
                        _no_row_transfer),
    "corrupt-row-tag": ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.rows_transfer",
                        _corrupt_row_tag),
    "no-lease-check": ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.block_generations",
                       _no_lease_check),
    "rows-not-imported": ("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
                          _rows_not_imported),
    "corrupt-rows": ("vllm.distributed.aux_output_connector.offload_rows", _corrupt_rows),
    "hold-finished-blocks": ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
                             _hold_finished_blocks),
    "unbounded-pd-decode-loads": ("vllm.distributed.aux_output_connector.disaggregated",
                                  _unbounded_pd_decode_loads),
    "uncapped-store-lookups": (f"{_STORE}.load_failures", _uncapped_store_lookups),
    "reversed-role-chains": ("vllm.distributed.kv_transfer.role_chains",
                             _reversed_role_chains),
    "unshared-handoff-loads": (
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler",
        _unshared_handoff_loads),
}

# Faults that apply to more than one connector: the rows of offloaded chunks come
# from the native offload's slots or from the Mooncake store's rows objects.
ALSO: dict[str, tuple[str, Callable[[ModuleType], None]]] = {
    "rows-not-imported": (f"{_STORE}.connector", _store_rows_not_imported),
    "corrupt-rows": (f"{_STORE}.rows", _corrupt_store_rows),
}

_fault = os.environ.get("E2E_FAULT")
if _fault in FAULTS:
    sys.meta_path.insert(0, _PatchAfterImport(*FAULTS[_fault]))
if _fault in ALSO:
    sys.meta_path.insert(0, _PatchAfterImport(*ALSO[_fault]))
