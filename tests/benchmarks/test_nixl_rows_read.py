"""benchmarks/nixl_rows_read.py: the rows READ and the KV READ it times move what
they should, between two real NIXL agents in two processes."""

from __future__ import annotations

import pytest

from benchmarks import nixl_rows_read as bench


def small_shape() -> bench.Shape:
    # 3 layers x top-2 of 8 experts, 4 blocks of 16 tokens, 256-byte KV pages.
    return bench.Shape(num_layers=3, top_k=2, num_experts=8, block_size=16,
                       num_blocks=4, kv_page_bytes=256)


def test_both_reads_land_and_are_counted() -> None:
    rows, kv = bench.measure(small_shape(), reads=3)
    assert (rows.label, kv.label) == ("rows READ", "KV READ")
    # Hand-derived: one slot per block, 16 x 3 x 2 uint8 rows + a 32-byte tag;
    # one KV descriptor per block, layer and K/V.
    assert (rows.descs, rows.nbytes) == (4, 4 * (16 * 3 * 2 + 32))
    assert (kv.descs, kv.nbytes) == (4 * 3 * 2, 4 * 3 * 2 * 256)
    for cost in (rows, kv):
        assert cost.post_ms > 0 and cost.wait_ms >= 0 and cost.first_post_ms > 0


def test_a_read_that_did_not_land_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Negative control: this process expects other bytes than the prefill process
    # (spawned, so it keeps the module's own value) wrote.
    monkeypatch.setattr(bench, "TAG_FILL", bench.TAG_FILL + 1)
    with pytest.raises(RuntimeError, match="did not land the prefill side's bytes"):
        bench.measure(small_shape(), reads=1)
