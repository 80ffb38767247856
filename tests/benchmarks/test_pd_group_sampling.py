"""benchmarks/pd_group_sampling.py: what it can check without servers."""

from __future__ import annotations

from benchmarks.pd_group_sampling import WAYS, cell_prompt
from tools.e2e.scenarios import BLOCK_SIZE


def test_no_two_cells_rounds_or_ways_share_a_first_block() -> None:
    # The run of `--sizes 1 4 8 16 --lengths 1024 8192 --rounds 2`: 96 prompts.
    lengths = [1024, 8192]
    first_blocks: dict[tuple[int, ...], tuple] = {}
    for n in (1, 4, 8, 16):
        for length in lengths:
            for round_index in range(3):
                for way in WAYS:
                    prompt = cell_prompt(n, length, lengths, round_index, way)
                    assert len(prompt) == length
                    block = tuple(prompt[:BLOCK_SIZE])
                    where = (n, length, round_index, way)
                    assert block not in first_blocks, (where, first_blocks.get(block))
                    first_blocks[block] = where
    assert len(first_blocks) == 4 * 2 * 3 * 2
