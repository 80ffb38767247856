"""Room for each block's trailer (its routed-experts rows slot) in the CPU tier's
chunk rows, and the file-system namespace that says it is there (patch
`carry-routed-experts-rows-through-secondary-offload`).

Sizes are derived by hand: a block of 8,192 KV bytes and a 160-byte trailer make a
chunk row of 8,352 bytes, rounded up to the tier's alignment; a private per-rank
tensor (the plain CPU tier on the CPU platform) has no room and takes none.
"""

from __future__ import annotations

import mmap

import pytest

from vllm.platforms import current_platform
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

KV_BYTES = 8192
TRAILER = 160
ROWS_FORMAT = "routed_experts_rows v1 layers=2 top_k=2 dtype=uint8 block_size=32"


def _config(trailer: int = 0, trailer_format: str | None = None) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(32, ("layers.0",), 0),),
        worker_kv_bytes_per_block=KV_BYTES,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 1 << 24},
        engine_id="trailer-test",
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        block_trailer_nbytes=trailer,
        block_trailer_format=trailer_format,
    )


def _aligned(nbytes: int) -> int:
    page = mmap.PAGESIZE
    return (nbytes + page - 1) // page * page


def test_a_shared_region_row_holds_the_trailer_after_the_kv() -> None:
    spec = TieringOffloadingSpec(_config(TRAILER, ROWS_FORMAT))
    assert spec.trailer_offset == KV_BYTES
    assert spec.cpu_page_size_per_worker == KV_BYTES  # the workers' KV, as before
    assert spec.kv_bytes_per_chunk == _aligned(KV_BYTES + TRAILER)
    assert spec.num_chunks == (1 << 24) // _aligned(KV_BYTES + TRAILER)


def test_without_a_trailer_the_row_is_unchanged() -> None:
    spec = TieringOffloadingSpec(_config())
    assert spec.trailer_offset is None
    assert spec.kv_bytes_per_chunk == _aligned(KV_BYTES)


@pytest.mark.skipif(not current_platform.is_cpu(), reason="the CPU platform's tier")
def test_a_private_tensor_takes_no_trailer() -> None:
    spec = CPUOffloadingSpec(_config(TRAILER, ROWS_FORMAT))
    assert spec.trailer_offset is None
    assert spec.kv_bytes_per_chunk == CPUOffloadingSpec(_config()).kv_bytes_per_chunk


def test_files_with_trailers_live_in_a_namespace_of_their_own(tmp_path) -> None:
    def mapper(config: OffloadingConfig) -> FileMapper:
        return FileMapper.from_offloading_spec(
            str(tmp_path), TieringOffloadingSpec(config)
        )

    plain, rows = mapper(_config()), mapper(_config(TRAILER, ROWS_FORMAT))
    assert rows.base_path != plain.base_path
    assert rows.get_run_config()["block_trailer_format"] == ROWS_FORMAT
    # Without a trailer the hashed fields stay what existing directories hash.
    assert "block_trailer_format" not in plain.get_run_config()
