"""Which slot of the shared offload region a worker takes (patch
`run-the-native-offload-worker-on-the-cpu-platform`).

TieringOffloadingSpec always puts the CPU tier in the shared region, and each
worker writes its pages at its slot. vLLM 0.31.0 asks the accelerator for the
device index, which the CPU platform does not have ("Cannot access accelerator
device when none is available"): the file-system tier could not start there. On
the CPU platform the slot is the worker's rank; elsewhere the device index
folded into [0, world_size), as before. vLLM 0.34.0 takes every worker's slot from
its rank upstream, so that base carries no such change (docs/bases.md) and its
series does not list this file.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.platforms import current_platform
from vllm.v1.kv_offload.cpu import spec


def _config(rank: int, world_size: int) -> SimpleNamespace:
    return SimpleNamespace(parallel=SimpleNamespace(rank=rank, world_size=world_size))


@pytest.mark.skipif(not current_platform.is_cpu(), reason="the CPU platform's rule")
@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 2), (3, 4)])
def test_a_cpu_worker_takes_its_rank(rank: int, world_size: int) -> None:
    assert spec.shared_region_slot(_config(rank, world_size)) == rank


def test_an_accelerator_worker_takes_its_device_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(spec.current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(spec.torch.accelerator, "current_device_index", lambda: 5)
    # Device 5 of a 2-worker replica: slot 1, whatever the rank says.
    assert spec.shared_region_slot(_config(0, 2)) == 1
