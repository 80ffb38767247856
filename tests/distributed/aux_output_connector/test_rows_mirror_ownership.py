"""The rows mirror belongs to an engine, a hand-off never rewrites a slot another
decode may be reading, and the fail-closed checks are not `assert`s (patch
`transfer-routed-experts-rows-with-the-kv-over-nixl`).

Rows are distinguishable: row p holds the value p in every slot.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from aux_worker_utils import bare_worker, run_step
from test_rows_transfer import BS, PROMPT, SHAPE, fmt, rows

from tests.dash_o import refused_under_dash_o
from tests.fork_base import HAS_ROWS_TRANSFER, only_with_rows_transfer
from vllm.distributed.aux_output_connector.connector import (
    AuxOutputConnectorMetadata,
    PackedBlockHashes,
)
from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer

pytestmark = only_with_rows_transfer

if HAS_ROWS_TRANSFER:
    from vllm.distributed.aux_output_connector.rows_transfer import (
        RowsExport,
        RowsImport,
        RowsMirror,
        SlotCheck,
        block_token_chains,
        get_rows_mirror,
        release_rows_mirror,
    )


def engine_config(instance_id: str) -> SimpleNamespace:
    """What get_rows_mirror reads of a VllmConfig: the switch and the format."""
    model = SimpleNamespace(
        get_total_num_hidden_layers=lambda: 3,
        get_num_experts_per_tok=lambda: 2,
        get_num_experts=lambda: 8,
    )
    return SimpleNamespace(
        instance_id=instance_id,
        kv_transfer_config=SimpleNamespace(enable_routed_experts_transfer=True),
        aux_output_config=SimpleNamespace(enabled=True),
        model_config=model,
        cache_config=SimpleNamespace(block_size=BS),
    )


# --- one mirror per engine ------------------------------------------------------------


def test_two_engines_in_one_process_have_their_own_mirrors() -> None:
    first, second = engine_config("engine-a"), engine_config("engine-b")
    mirror_a = get_rows_mirror(first, 16)
    mirror_b = get_rows_mirror(second, 24)  # another KV cache size
    try:
        assert mirror_a is not mirror_b
        assert (mirror_a.num_blocks, mirror_b.num_blocks) == (16, 24)
        # The KV connector worker of the same engine gets the same mirror.
        assert get_rows_mirror(first, 16) is mirror_a
    finally:
        release_rows_mirror(mirror_a)
        release_rows_mirror(mirror_b)


def test_an_engine_asking_for_another_size_gets_a_clear_error() -> None:
    config = engine_config("engine-c")
    mirror = get_rows_mirror(config, 16)
    try:
        with pytest.raises(RuntimeError) as error:
            get_rows_mirror(config, 32)
        message = str(error.value)
        assert "engine engine-c" in message
        assert "for 16 blocks" in message and "for 32" in message
    finally:
        release_rows_mirror(mirror)
    # Once its worker closed, the engine may be rebuilt at another size.
    rebuilt = get_rows_mirror(config, 32)
    assert rebuilt.num_blocks == 32
    release_rows_mirror(rebuilt)


def test_no_mirror_without_the_switch() -> None:
    config = engine_config("engine-d")
    config.kv_transfer_config.enable_routed_experts_transfer = False
    assert get_rows_mirror(config, 16) is None


# --- a shared prefix slot's bytes never change under a read ---------------------------
#
# Hand-off 1 (rows from 0) wrote block 0's slot; its decode may be reading it when
# hand-off 2 of a prompt with the same first block but another
# routed_experts_prompt_start writes its rows. Before the fix hand-off 2 wrote
# [start, 4) and its tag, so hand-off 1's check (rows [0, 4)) failed: a spurious
# KV load error, HTTP 500 under kv_load_failure_policy=fail. Now every hand-off
# writes a block's rows from the block's start when the prefill has them, so the
# second write puts the same bytes.


def _export(mirror: RowsMirror, start: int) -> None:
    chains = tuple(block_token_chains(PROMPT, BS))
    mirror.write(
        RowsExport(start, 10, (5, 6, 7)[start // BS :], chains), rows(start, 10)
    )


def test_a_slot_of_other_tokens_is_written() -> None:
    """Negative control: a block id that now holds another prompt's block (the
    first lease ended) gets the new rows and tag."""
    mirror = RowsMirror(fmt(), num_blocks=8)
    _export(mirror, start=0)
    other = [99, *PROMPT[1:]]
    chains = tuple(block_token_chains(other, BS))
    mirror.write(RowsExport(0, 10, (5, 6, 7), chains), rows(0, 10) + 50)
    assert mirror.slot_problem(SlotCheck(5, chains[0], 0, BS)) is None
    np.testing.assert_array_equal(mirror.read(RowsImport(0, 4, (5,))), rows(0, 4) + 50)


def _prefill_worker(mirror: RowsMirror):
    worker = bare_worker(RoutedExpertsBuffer(np.dtype(np.uint8), SHAPE, BS, 2, 16, 2))
    worker._rows_mirror = mirror
    return worker


@pytest.mark.parametrize("prompt_start", [1, 2, 3, 5, 6])
def test_a_hand_off_writes_whole_blocks_whatever_its_prompt_start(
    prompt_start: int,
) -> None:
    """Prefill computed the whole prompt, so it has rows from 0: the slot of the
    block holding the prompt start gets the rows from that block's start, and
    two hand-offs with different starts write the same bytes (hand-off 1's
    check still passes after hand-off 2's write)."""
    slots = []
    for start in (0, prompt_start):
        mirror = RowsMirror(fmt(), num_blocks=8)
        worker = _prefill_worker(mirror)
        chains = tuple(block_token_chains(PROMPT, BS))
        export = RowsExport(start, 10, (5, 6, 7)[start // BS :], chains)
        hashes = {
            "p": PackedBlockHashes(b"".join(bytes([i]) * 32 for i in range(2)), 32)
        }
        metadata = AuxOutputConnectorMetadata(
            0, {"p": start}, hashes, (), rows_exports={"p": export}
        )
        run_step(worker, metadata, "p", 0, rows(0, 10))
        slots.append(mirror.slots.copy())
    first = prompt_start // BS
    # The slots the later hand-off writes (blocks from the one holding its start).
    np.testing.assert_array_equal(slots[0][5 + first :], slots[1][5 + first :])
    chains = block_token_chains(PROMPT, BS)
    assert mirror.slot_problem(SlotCheck(5 + first, chains[first], 0, BS)) is None
    np.testing.assert_array_equal(
        mirror.read(RowsImport(first * BS, 10, (5, 6, 7)[first:])), rows(first * BS, 10)
    )


# --- the fail-closed checks hold under python -O -------------------------------------


def test_fail_closed_checks_hold_under_python_dash_o() -> None:
    setup = """
        import numpy as np
        from vllm.distributed.aux_output_connector.rows_transfer import (
            RowsExport, RowsFormat, RowsImport, RowsMirror)
        mirror = RowsMirror(RowsFormat(3, 2, "uint8", 4), num_blocks=4)
    """
    calls = {
        "uncovered import": "mirror.read(RowsImport(0, 8, (1,)))",
        "short rows": (
            "mirror.write(RowsExport(0, 4, (1,), (7,)), np.zeros((3, 3, 2), np.uint8))"
        ),
    }
    assert refused_under_dash_o(setup, calls) == list(calls)
